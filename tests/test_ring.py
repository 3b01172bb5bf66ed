"""Ring attention on simulated CPU meshes (2, 4, 8 devices) vs the dense reference.

Every case lays the unsharded inputs out in the ring's token order, runs
``ring_attention_sharded`` forward and backward (one jit: output and the VJP of a random
cotangent) and compares out, dq, dk, dv (and d_sinks) in original order with
``reference_attention`` at the float32 tolerances below. Most cases use the plain-jnp Splash
backend (fast on CPU); the interpret cases run the Pallas TPU interpreter, including rings
whose shard pairs differ in activity across devices.
"""

import dataclasses
import functools
import os
import subprocess
import sys
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import ringsplash as rs
from ringsplash import layouts, masks
from ringsplash.parallel.ring import ring_attention, ring_attention_sharded
from ringsplash.parallel.ring_plan import critical_path, ring_plan, ring_work
from ringsplash.splash.config import SplashConfig
from support.attention_inputs import max_err
from support.masks import MASK_KINDS, make_mask, packed_segments
from support.meshes import mesh
from support.tiers import fast_first

# Float32 max abs error vs the reference, measured on the N = 4 mask x layout grid (xla
# backend, 19 of 21 cases) and the five interpret cases: out <= 9.5e-7, dq / dk / dv <= 5.7e-6,
# d_sinks <= 1.4e-6 (outside testing over N = 2 / 4 / 8 reported <= 3e-6).
OUT_TOL = 8e-6  # ~8x headroom
GRAD_TOL = 5e-5  # ~9x headroom (dK/dV sum S/N-row partial products on each of N steps)
TOLS = {"out": OUT_TOL, "dq": GRAD_TOL, "dk": GRAD_TOL, "dv": GRAD_TOL, "d_sinks": GRAD_TOL}
LAYOUTS = ("contiguous", "zigzag", "striped")
XLA = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")


def run_both(key, mask, *, n, layout, heads=2, kv_heads=1, s=1024, d=32, segments=False, sinks=False,
             cap=None, config=XLA, unroll=1):
    """Returns ((out, dq, dk, dv, d_sinks) of the ring, same of the reference), original order."""
    kq, kk, kv, kd, ks, kseg = jax.random.split(key, 6)
    q = jax.random.normal(kq, (heads, s, d), jnp.float32)
    k = jax.random.normal(kk, (kv_heads, s, d), jnp.float32)
    v = jax.random.normal(kv, (kv_heads, s, d), jnp.float32)
    d_out = jax.random.normal(kd, (heads, s, d), jnp.float32)
    snk = jax.random.normal(ks, (heads,), jnp.float32) if sinks else None
    seg = packed_segments(kseg, s) if segments else None
    m = mesh(n)
    lay = lambda x: layouts.permute(x, layout, n, axis=x.ndim - 1 if x.ndim == 1 else 1)
    unlay = lambda x: layouts.unpermute(x, layout, n, axis=1)

    def ring(q, k, v, snk):
        ids = None if seg is None else rs.SegmentIds(q=lay(seg), kv=lay(seg))
        fn = lambda q, k, v, snk: ring_attention_sharded(
            q, k, v, mask, mesh=m, axis_name="ctx", segment_ids=ids, layout=layout,
            logit_soft_cap=cap, sinks=snk, config=config, unroll=unroll,
        )
        out, vjp = jax.vjp(fn, lay(q), lay(k), lay(v), snk)
        dq, dk, dv, dsnk = vjp(lay(d_out))
        return unlay(out), unlay(dq), unlay(dk), unlay(dv), dsnk

    def ref(q, k, v, snk):
        ids = None if seg is None else rs.SegmentIds(q=seg, kv=seg)
        fn = lambda q, k, v, snk: rs.reference_attention(q, k, v, mask, segment_ids=ids, logit_soft_cap=cap, sinks=snk)
        out, vjp = jax.vjp(fn, q, k, v, snk)
        return (out, *vjp(d_out))

    return jax.jit(ring)(q, k, v, snk), jax.jit(ref)(q, k, v, snk)


def assert_close(got, want):
    for name, a, b in zip(("out", "dq", "dk", "dv", "d_sinks"), got, want):
        if b is None:
            assert a is None, name
            continue
        assert not np.any(np.isnan(np.asarray(a))), f"{name} has NaN"
        err = max_err(a, b)
        assert err <= TOLS[name], f"{name}: max abs error {err:.3g} > {TOLS[name]}"


# ----------------------------------------------------------------------------------------
# every mask type x every layout (N = 4). Features rotate over the grid so each mask and each
# layout is run both with and without segment ids, and GQA / MQA / soft-cap / sinks all appear.


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_ring_mask_layout_matches_reference(key, kind, layout):
    i = MASK_KINDS.index(kind) + LAYOUTS.index(layout)
    heads, kv_heads = ((4, 2), (2, 1), (4, 1))[i % 3]  # GQA, MQA, MQA with groups of 4
    kw = {"segments": i % 2 == 0, "sinks": i % 3 == 1, "cap": 30.0 if i % 3 == 2 else None}
    got, want = run_both(key, make_mask(kind, 1024, heads), n=4, layout=layout, heads=heads, kv_heads=kv_heads, **kw)
    assert_close(got, want)


# ----------------------------------------------------------------------------------------
# mesh sizes 2 and 8, all features at once; at N = 8 the error is compared with the
# single-device Splash error on the same inputs


@pytest.mark.parametrize("layout", fast_first(("zigzag", "contiguous", "striped")))
@pytest.mark.slow
def test_ring_two_devices_all_features(key, layout):
    got, want = run_both(key, make_mask("causal", 512, 4), n=2, layout=layout, heads=4, kv_heads=2, s=512,
                         segments=True, sinks=True, cap=20.0, unroll=2)
    assert_close(got, want)


@pytest.mark.slow
@pytest.mark.xla_optimized  # compares two programs' rounding: as users compile them
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_eight_devices_error_within_twice_single_device(key, layout):
    s, heads, kv_heads, d = 2048, 4, 2, 32
    mask = make_mask("causal", s, heads)
    got, want = run_both(key, mask, n=8, layout=layout, heads=heads, kv_heads=kv_heads, s=s, d=d,
                         segments=True, sinks=True)
    assert_close(got, want)

    # the single-device Splash (same backend, same block sizes) on the very same inputs
    kq, kk, kv, kd, ks, kseg = jax.random.split(key, 6)
    q = jax.random.normal(kq, (heads, s, d), jnp.float32)
    k = jax.random.normal(kk, (kv_heads, s, d), jnp.float32)
    v = jax.random.normal(kv, (kv_heads, s, d), jnp.float32)
    d_out = jax.random.normal(kd, (heads, s, d), jnp.float32)
    snk = jax.random.normal(ks, (heads,), jnp.float32)
    seg = packed_segments(kseg, s)
    ids = rs.SegmentIds(q=seg, kv=seg)

    @jax.jit
    def single(q, k, v, snk):
        fn = lambda q, k, v, snk: rs.splash_attention(q, k, v, mask, segment_ids=ids, sinks=snk, config=XLA)
        out, vjp = jax.vjp(fn, q, k, v, snk)
        return (out, *vjp(d_out))

    for name, r, o, w in zip(("out", "dq", "dk", "dv", "d_sinks"), got, single(q, k, v, snk), want):
        ring_err, single_err = max_err(r, w), max_err(o, w)
        assert ring_err <= 2 * single_err, f"{name}: ring error {ring_err:.3g} > 2 x single-device {single_err:.3g}"


# ----------------------------------------------------------------------------------------
# merge bookkeeping: a wrong log base, a dropped or doubled step, or a sink added per step
# all break these


@pytest.mark.slow
def test_ring_remote_only_keys_and_mostly_empty_rows(key):
    """Rows of q shard ``a`` attend keys of one remote kv shard, the one visiting at step
    ``t_a`` (each of the steps 1 .. N-1 is some shard's), half of them also their own shard
    (step 0, so two non-empty partial softmaxes merge), and a quarter of the rows attend
    nothing anywhere: most rows are empty on most steps. A dropped step, a base-2 lse in the
    merge or a sink added per step all fail this."""
    n, s = 4, 1024
    shard = s // n
    arr = np.zeros((s, s), bool)
    remote = {}
    for a in range(n):
        t = 1 + a % (n - 1)
        b = remote[a] = (a - t) % n  # contiguous layout: device a holds kv shard (a - t) mod N at step t
        r0, r1, half = a * shard, a * shard + 3 * shard // 4, a * shard + shard // 2  # rows [r1, end) empty
        arr[r0:r1, b * shard : (b + 1) * shard] = np.tril(np.ones((r1 - r0, shard), bool), k=17 * a)
        arr[r0:half, r0 : r0 + shard] = np.tril(np.ones((half - r0, shard), bool))
    mask = masks.NumpyMask(arr)
    plan = ring_plan(mask, n, "contiguous", XLA)
    assert sorted(map(tuple, np.argwhere(plan.active))) == sorted([(a, a) for a in range(n)] + list(remote.items()))
    for sinks in (True, False):
        got, want = run_both(key, mask, n=n, layout="contiguous", heads=2, kv_heads=2, s=s, sinks=sinks)
        assert_close(got, want)
    empty_rows = np.asarray(got[0])[:, ~arr.any(1)]
    assert np.all(empty_rows == 0), "rows attending nothing must return exactly 0"


@pytest.mark.slow
def test_ring_scores_spread_over_all_shards_need_every_step(key):
    """Full attention with large logits: each shard holds a similar share of the softmax mass,
    so a dropped step, a base-2 lse or a per-step sink moves the output far beyond 1e-4."""
    n, s = 4, 512
    got, want = run_both(key, masks.FullMask((s, s)), n=n, layout="striped", heads=2, kv_heads=2, s=s, d=32)
    assert_close(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_non_finite_values_at_unattended_positions_never_leak(key, layout):
    """The masked-values contract through the ring: K / V at positions no query attends (the
    last quarter is a padding segment, so with the contiguous layout one device's whole kv
    shard is poison, plus masked columns inside live shards) are NaN / +-Inf while they rotate
    past every device. Every output and gradient equals the reference on clean inputs, rows
    of the padding segment return exactly 0, and the poisoned positions get dk = dv = 0."""
    n, s, heads, d = 4, 1024, 2, 32
    arr = np.tril(np.ones((s, s), bool))
    arr[:, 100:140] = False  # columns nobody attends, inside a live shard
    arr[np.arange(s), np.arange(s)] = True
    arr[:, 100:140] = False
    seg = np.repeat([3, 7, -1], [400, 368, 256]).astype(np.int32)  # -1: padding, its own segment
    seg_q = np.where(seg < 0, -2, seg).astype(np.int32)  # padding queries match no key
    attended = arr & (seg_q[:, None] == seg[None, :])
    unattended = ~attended.any(0)
    assert unattended[768:].all() and unattended[100:140].all()
    mask = masks.NumpyMask(arr)
    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (heads, s, d), jnp.float32)
    k, v = (jax.random.normal(x, (1, s, d), jnp.float32) for x in (kk, kv))
    d_out = jax.random.normal(kd, (heads, s, d), jnp.float32)
    poison = jnp.asarray(np.resize([np.nan, np.inf, -np.inf], (1, s, d)), jnp.float32)
    bad = jnp.asarray(unattended)[None, :, None]
    k_bad, v_bad = jnp.where(bad, poison, k), jnp.where(bad, poison[:, ::-1], v)
    lay = lambda x: layouts.permute(x, layout, n, axis=0 if x.ndim == 1 else 1)
    unlay = lambda x: layouts.unpermute(x, layout, n, axis=1)

    def ring(q, k, v):
        ids = rs.SegmentIds(q=lay(jnp.asarray(seg_q)), kv=lay(jnp.asarray(seg)))
        fn = lambda q, k, v: ring_attention_sharded(q, k, v, mask, mesh=mesh(n), axis_name="ctx", layout=layout,
                                                    segment_ids=ids, logit_soft_cap=6.0, config=XLA)
        out, vjp = jax.vjp(fn, lay(q), lay(k), lay(v))
        return tuple(unlay(x) for x in (out, *vjp(lay(d_out))))

    def ref(q, k, v):
        ids = rs.SegmentIds(q=jnp.asarray(seg_q), kv=jnp.asarray(seg))
        fn = lambda q, k, v: rs.reference_attention(q, k, v, mask, segment_ids=ids, logit_soft_cap=6.0)
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(d_out))

    got, want = jax.jit(ring)(q, k_bad, v_bad), jax.jit(ref)(q, k, v)  # reference on clean inputs
    for name, a in zip(("out", "dq", "dk", "dv"), got):
        assert bool(jnp.all(jnp.isfinite(a))), f"{name} has non-finite values"
    assert_close(got, (*want, None))
    out, _, dk, dv = got
    assert bool(jnp.all(out[:, seg_q < 0] == 0)), "padding rows attend nothing: exactly 0"
    assert bool(jnp.all(dk[:, unattended] == 0)) and bool(jnp.all(dv[:, unattended] == 0))


# ----------------------------------------------------------------------------------------
# Pallas TPU kernels (interpreter) inside the ring. The TPU interpreter synchronises all devices
# at every kernel call: the ring runs every kernel on every device with it (a device with no work
# at a step computes an empty one), and a mesh that would hold every client thread is refused
# (parallel/_common.py). A hang would still fail the one test, with a stack (pytest-timeout).


def interpret_case_errors(kind: str, n: int, layout: str, s: int, sinks: bool, segments: bool,
                          tpu_interpreter: bool = True) -> dict:
    """Max abs errors (out, dq, dk, dv, d_sinks) of the interpret-backend ring vs the reference:
    the Pallas TPU interpreter (unwritten memory reads as NaN), or the default (the generic one)."""
    params = pltpu.InterpretParams(uninitialized_memory="nan") if tpu_interpreter else None
    cfg = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="interpret",
                       interpret_params=params)
    key = jax.random.key(zlib.crc32(f"{kind}-{n}-{layout}".encode()))
    got, want = run_both(key, make_mask(kind, s, 2), n=n, layout=layout, heads=2, kv_heads=1, s=s, d=64,
                         segments=segments, sinks=sinks, config=cfg)
    errs = {}
    for name, a, b in zip(("out", "dq", "dk", "dv", "d_sinks"), got, want):
        if b is not None:
            errs[name] = float("nan") if np.any(np.isnan(np.asarray(a))) else max_err(a, b)
    return errs


class InterpretCase(NamedTuple):
    kind: str
    n: int
    layout: str
    s: int
    sinks: bool
    segments: bool
    tpu_interpreter: bool = True


INTERPRET_CASES = {
    # every shard pair active: all devices run every kernel
    "zigzag_causal_n2": InterpretCase("causal", 2, "zigzag", 512, sinks=True, segments=True),
    # inactive shard pairs: devices differ in which steps have work
    "contiguous_causal_n2": InterpretCase("causal", 2, "contiguous", 512, sinks=False, segments=True),
    "contiguous_causal_n4": InterpretCase("causal", 4, "contiguous", 512, sinks=True, segments=False),
    # other masks' kernels on the ring: Pallas' generic interpreter (same kernels, ~5x cheaper; the
    # TPU interpreter's barriers are covered by the causal cases above)
    "contiguous_prefix_lm_n4": InterpretCase("prefix_lm", 4, "contiguous", 512, sinks=False, segments=False,
                                             tpu_interpreter=False),
    "contiguous_local_n4": InterpretCase("local", 4, "contiguous", 512, sinks=False, segments=True,
                                         tpu_interpreter=False),
    # 8 devices: the TPU interpreter deadlocks here (hung before the generic-interpreter default)
    "striped_causal_n8_default": InterpretCase("causal", 8, "striped", 1024, sinks=True, segments=True,
                                               tpu_interpreter=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", INTERPRET_CASES)
def test_ring_interpret_backend_matches_reference(case):
    errs = interpret_case_errors(**INTERPRET_CASES[case]._asdict())
    print(case, errs)
    assert errs.keys() >= {"out", "dq", "dk", "dv"}, errs
    assert all(err <= TOLS[name] for name, err in errs.items()), errs


# ----------------------------------------------------------------------------------------
# ring_attention inside the caller's own shard_map


@pytest.mark.slow
def test_ring_attention_inside_user_shard_map(key):
    n, s, layout = 4, 1024, "zigzag"
    mask = masks.CausalMask((s, s))
    q = jax.random.normal(key, (2, s, 32), jnp.float32)
    ql = layouts.permute(q, layout, n, axis=1)
    fn = jax.shard_map(
        functools.partial(ring_attention, mask=mask, axis_name="sp", layout=layout, config=XLA),
        mesh=mesh(n, "sp"), in_specs=P(None, "sp"), out_specs=P(None, "sp"), check_vma=False,
    )
    out = layouts.unpermute(jax.jit(lambda x: fn(x, x, x))(ql), layout, n, axis=1)
    assert max_err(out, rs.reference_attention(q, q, q, mask)) <= OUT_TOL


# ----------------------------------------------------------------------------------------
# bad input


def _qkv(s=1024, heads=2, kv_heads=1, d=32):
    return jnp.zeros((heads, s, d)), jnp.zeros((kv_heads, s, d)), jnp.zeros((kv_heads, s, d))


def test_ring_rejects_mesh_without_axis():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"no axis_name='ctx'"):
        ring_attention_sharded(q, k, v, masks.CausalMask((1024, 1024)), mesh=mesh(4, "other"), axis_name="ctx")


@pytest.mark.parametrize(
    "layout, n, s, match",
    [
        ("contiguous", 4, 768, r"S // 4 = 768 // 4 = 192 tokens per shard\): SplashConfig.block_q=128 cannot tile "
                               r"the 192-token shard.*block_q=256"),
        ("striped", 8, 1536, r"cannot tile the 192-token shard.*S=2048\)$"),
        # zigzag half-shards are parts of the shard the kernel tiles: a short one must itself be a
        # multiple of 128 to lower for TPU (S = 1000 over 4 ran here with 125-token blocks and did not lower)
        ("zigzag", 4, 1536, r"cannot tile the 192-token zigzag half-shard"),
        ("zigzag", 4, 1000, r"SplashConfig.block_q=128 cannot tile the 125-token zigzag half-shard: .* and a multiple "
                            r"of 128 \(the zigzag half-shard is part of the 250-token array the kernel tiles.*No block "
                            r"size fits: use S divisible by 8 x 128 = 1024 \(e.g. S=1024\), or SplashConfig\(backend='xla'\)"),
        ("zigzag", 4, 512, r"cannot tile the 64-token zigzag half-shard"),
    ],
)
def test_ring_rejects_lengths_no_block_tiles(layout, n, s, match):
    """Blocks shrink to fit shards (tests/test_entry_point_checks.py); a shard no block tiles for
    the Pallas TPU kernels is refused (backend "auto": they run when the call is lowered for TPU)."""
    q, k, v = _qkv(s)
    with pytest.raises(ValueError, match=match):
        ring_attention_sharded(q, k, v, masks.CausalMask((s, s)), mesh=mesh(n), axis_name="ctx", layout=layout,
                               config=dataclasses.replace(XLA, backend="auto"))
    if s in (512, 1000):  # plain XLA has no TPU tiling: the short half-shard is one block
        from ringsplash.parallel.ring_plan import fit_ring_blocks

        assert fit_ring_blocks(s, n, layout, XLA).block_shape == (s // 8, s // 8)


def test_ring_refuses_the_tpu_interpreter_when_the_mesh_holds_every_client_thread(monkeypatch):
    """8 simulated devices, NPROC=8 (the client of a host with <= 8 cores): the mesh's 8 devices
    would hold all 8 threads (see parallel/_common.py); the error names the way out."""
    monkeypatch.setenv("NPROC", "8")  # read at the call: the same rule on any CI host
    q, k, v = _qkv()
    cfg = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="interpret",
                       interpret_params=pltpu.InterpretParams())
    with pytest.raises(ValueError, match=r"ring_attention: .*TPU interpreter.*mesh's 8 devices .*all 8 threads"
                                         r".*interpret_params='generic'.*NPROC=9"):
        jax.eval_shape(functools.partial(ring_attention_sharded, mask=masks.CausalMask((1024, 1024)), mesh=mesh(8),
                                         axis_name="ctx", config=cfg), q, k, v)


#: the TPU-interpreter ring of 4 devices, jitted, zigzag, causal, 2 heads, d 64, in a process of
#: its own (a client's thread count is fixed when JAX initialises): prints the max error vs the reference
TPU_INTERPRETER_RING = """
import sys, jax
jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
import ringsplash as rs
n, s = 4, 1024
mesh = jax.sharding.Mesh(jax.devices()[:n], ("ctx",))
q, k, v = jax.random.normal(jax.random.key(7), (3, 2, s, 64))
m = rs.masks.CausalMask((s, s))
cfg = rs.SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="interpret",
                      interpret_params=pltpu.InterpretParams(uninitialized_memory="nan"))
perm = rs.layouts.permutation("zigzag", s, n)
f = jax.jit(lambda q, k, v: rs.ring_attention_sharded(q, k, v, m, mesh=mesh, axis_name="ctx", layout="zigzag",
                                                      config=cfg))
try:
    out = rs.layouts.unpermute(f(q[:, perm], k[:, perm], v[:, perm]), "zigzag", n, axis=1)
except ValueError as e:
    print("REFUSED", e)
else:
    print("ERROR", float(jnp.max(jnp.abs(out - rs.reference_attention(q, k, v, m)))))
"""


@pytest.mark.slow
@pytest.mark.parametrize("cpu_devices", [4, 5])
def test_tpu_interpreter_ring_runs_or_is_refused_never_hangs(cpu_devices):
    """With NPROC=2 (a 2-core host's client), 4 of 4 devices hung in XLA's rendezvous until it
    aborted the process; now refused at once. 4 of 5 devices leave the client a thread: it runs
    and agrees with the reference."""
    env = {**os.environ, "NPROC": "2", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", TPU_INTERPRETER_RING, str(cpu_devices)], env=env, text=True,
                          capture_output=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if cpu_devices == 4:
        assert "REFUSED ring_attention:" in proc.stdout and "mesh's 4 devices" in proc.stdout, proc.stdout
    else:
        assert float(proc.stdout.rsplit("ERROR", 1)[1]) <= OUT_TOL, proc.stdout


def test_ring_rejects_unknown_layout():
    q, k, v = _qkv()
    # Literal-typed: the library's ValueError, or the test run's type check (TypeError)
    with pytest.raises((ValueError, TypeError), match=r"layout.*'spiral'"):
        ring_attention_sharded(q, k, v, masks.CausalMask((1024, 1024)), mesh=mesh(4), axis_name="ctx",
                               layout="spiral", config=XLA)


def test_ring_rejects_segment_ids_of_wrong_length():
    q, k, v = _qkv()
    bad = rs.SegmentIds(q=jnp.zeros(1024, jnp.int32), kv=jnp.zeros(1000, jnp.int32))
    with pytest.raises(ValueError, match=r"segment_ids.kv must have shape \(1024,\)"):
        ring_attention_sharded(q, k, v, masks.CausalMask((1024, 1024)), mesh=mesh(4), axis_name="ctx",
                               segment_ids=bad, config=XLA)
    # inside shard_map the ids are the local shard's: a global-length array is rejected
    fn = jax.shard_map(
        lambda q, k, v, ids: ring_attention(q, k, v, masks.CausalMask((1024, 1024)), axis_name="ctx",
                                            segment_ids=ids, config=XLA),
        mesh=mesh(4), in_specs=(P(None, "ctx"),) * 3 + (rs.SegmentIds(P(), P()),), out_specs=P(None, "ctx"),
        check_vma=False,
    )
    full = rs.SegmentIds(q=jnp.zeros(1024, jnp.int32), kv=jnp.zeros(1024, jnp.int32))
    with pytest.raises(ValueError, match=r"segment_ids.q must have shape \(256,\).*local length S/N = 256"):
        jax.eval_shape(fn, q, k, v, full)


def test_ring_attention_outside_shard_map_says_what_to_do():
    q, k, v = _qkv(256)
    with pytest.raises(ValueError, match=r"inside jax.shard_map.*ring_attention_sharded"):
        ring_attention(q, k, v, masks.CausalMask((256, 256)), axis_name="ctx", config=XLA)


def test_ring_work_and_critical_path_measure_the_layouts_balance():
    """Causal zigzag gives every ring step the same work (critical path = total / N);
    contiguous makes the last q shard's device the bottleneck; ``rs.clear_caches()`` drops
    the cached plans."""
    s, n = 4096, 4
    mask = masks.CausalMask((s, s))
    work = {lay: ring_work(ring_plan(mask, n, lay, XLA)) for lay in ("zigzag", "contiguous")}
    for w in work.values():
        assert w.shape == (n, n) and w.dtype == np.int64
        assert w.sum() == (s // 128) * (s // 128 + 1) // 2  # every non-empty 128-block of the causal mask
    assert critical_path(work["zigzag"]) * n == work["zigzag"].sum()
    assert critical_path(work["contiguous"]) * n > work["contiguous"].sum()
    assert critical_path(np.eye(n, dtype=np.int64) * 5) == 5  # step 0 only: every device its own shard
    plan = ring_plan(mask, n, "zigzag", XLA)
    assert ring_plan(mask, n, "zigzag", XLA) is plan
    rs.clear_caches()
    assert ring_plan(mask, n, "zigzag", XLA) is not plan
