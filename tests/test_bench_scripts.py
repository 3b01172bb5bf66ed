"""Smoke tests of the benchmark scripts (each runs as a subprocess and prints its tables): bench_splash.py --quick
(S=8K, causal, v5e compile), bench_hf.py / bench_inference.py --tiny, bench_train_tpu.py / bench_inference_tpu.py
--cpu-smoke; and the FLOP counts of the last two."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from support.processes import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script(name: str):
    """``scripts/<name>.py`` imported as a module (with ``scripts/`` on the path for its own imports)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return module


@pytest.mark.tpu_compile
@pytest.mark.e2e
def test_bench_splash_quick_prints_tables():
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_splash.py"), "--quick"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "| S | mask | active / total blocks (per head) |" in out
    assert "| target | S | mask | fwd temp MiB |" in out
    assert "| 8K | causal | 136 / 256 |" in out  # 16 x 17 / 2 blocks of 512 at 8K
    assert "| v5e:2x2 | 8K | causal |" in out and "ERROR" not in out
    assert "not a TPU speed" in out


@pytest.mark.multiprocess
@pytest.mark.e2e
def test_bench_hf_tiny_prints_tables(tmp_path):
    """scripts/bench_hf.py --tiny: the write, load (whole, 4 devices in one process, 2 processes
    via the launcher) and forward sections run; each sharded process reads its share; the two
    forwards' logits agree; the checkpoint is deleted at the end."""
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_hf.py"), "--tiny", "--seq-lens", "256", "--repeats", "1",
         "--layouts", "whole", "1x4", "2x1", "--dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "| load | process | seconds | read (GiB) |" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("| FSDP, 2 processes x 1 device |")]
    assert len(rows) == 2 and all("| 0.50 |" in r for r in rows), out
    assert "| whole, 1 process x 1 device | 0 |" in out and "| FSDP, 1 process x 4 devices | 0 |" in out
    diff = next(ln for ln in out.splitlines() if "transformers (sdpa)" in ln).split("|")[7]
    assert float(diff.split()[0]) < 1e-4, out
    assert not os.path.exists(tmp_path / "tiny")


@pytest.mark.e2e
def test_bench_inference_tiny_prints_tables():
    """scripts/bench_inference.py --tiny: the prefill and decode tables, transformers side by side and the
    sharded-cache column."""
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_inference.py"), "--tiny"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "| prompt | ringsplash (s) | transformers (s) | speed-up |" in out
    assert ("| batch | prompt | host memory roofline (tok/s) | generate, ringsplash (tok/s) | "
            "generate, transformers (tok/s) | ratio |") in out, out
    rows = [ln for ln in out.splitlines() if ln.startswith(("| 1 | 256 |", "| 2 | 256 |"))]
    # every rate measured: the host's roofline, both generates, both step loops, the sharded column
    assert len(rows) == 2 and all(float(c) > 0 for r in rows for c in _cells(r)[2:]), out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_model_bench_flop_counts_match_a_direct_count():
    """The FLOP formulas of bench_train_tpu.py / bench_inference_tpu.py: causal attention counts 4·dh FLOPs
    per attended pair per head per layer (pairs counted from the mask itself), and N is every parameter but
    the embedding table and the unembedding."""
    import equinox as eqx
    import jax
    import numpy as np

    from ringsplash.model import Transformer

    mb = _script("_model_bench")
    shape = mb.Shape(layers=3, d_model=64, heads=4, kv_heads=2, head_dim=16, mlp=96, vocab=50)
    config = mb.model_config(shape, 256, param_dtype="float32", compute_dtype="bfloat16")
    s = 40
    pairs = int(np.tril(np.ones((s, s), bool)).sum())
    assert mb.causal_attention_flops(config, s) == 3 * 4 * (4 * 16) * pairs  # layers x heads x 4·dh x pairs
    counts = mb.param_counts(config)
    model = Transformer(config, key=jax.random.key(0))
    total = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    assert counts.embedding == 50 * 64 and counts.unembedding == 64 * 50
    assert counts.body + counts.embedding + counts.unembedding == total
    assert counts.param_bytes == 4 * total


def test_profile_counts_each_device_op_once_without_the_ops_nested_in_it(tmp_path):
    """profile_splash_tpu.device_op_times (used by bench_train_tpu --profile): a ``while`` op's span holds
    its body's ops; its time is its own (span minus children), so the ops' times add up to the device time."""
    import gzip
    import json

    prof = _script("profile_splash_tpu")
    meta = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:TPU:0")),
            dict(ph="M", name="thread_name", pid=1, tid=2, args=dict(name="XLA Ops"))]
    ops = []
    for step in range(2):  # two steps: a while loop (100 us) around a kernel (60) and a fusion (30), then a copy
        t = 1000 * step
        ops += [dict(ph="X", pid=1, tid=2, ts=t, dur=100, name="while.1"),
                dict(ph="X", pid=1, tid=2, ts=t + 5, dur=60, name="splash_forward"),
                dict(ph="X", pid=1, tid=2, ts=t + 70, dur=30, name="fusion.3"),
                dict(ph="X", pid=1, tid=2, ts=t + 100, dur=8, name="copy.2")]
    (tmp_path / "run").mkdir()
    with gzip.open(tmp_path / "run" / "perfetto_trace.json.gz", "wt") as f:
        json.dump(dict(traceEvents=meta + ops), f)
    times = {name: (ms, n) for name, ms, n in prof.device_op_times(str(tmp_path), calls=2)}
    assert times == {"splash_forward": (0.06, 1), "fusion.3": (0.03, 1), "while.1": (0.01, 1), "copy.2": (0.008, 1)}


def test_profile_counts_ops_of_the_same_name_in_two_programs_apart(tmp_path):
    """With an "XLA Modules" thread, an op is named by its program too: a prefill's ``fusion.3`` and a decode
    program's ``fusion.3`` (HLO names repeat across programs) are two rows; an op outside every program keeps
    its bare name."""
    import gzip
    import json

    prof = _script("profile_splash_tpu")
    meta = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:TPU:0")),
            dict(ph="M", name="thread_name", pid=1, tid=2, args=dict(name="XLA Ops")),
            dict(ph="M", name="thread_name", pid=1, tid=3, args=dict(name="XLA Modules"))]
    events = [dict(ph="X", pid=1, tid=3, ts=0, dur=100, name="jit_prefill(7)"),
              dict(ph="X", pid=1, tid=2, ts=10, dur=50, name="fusion.3"),
              dict(ph="X", pid=1, tid=3, ts=200, dur=100, name="jit__steps(8)"),
              dict(ph="X", pid=1, tid=2, ts=210, dur=20, name="fusion.3"),
              dict(ph="X", pid=1, tid=3, ts=400, dur=100, name="jit__steps(9)"),
              dict(ph="X", pid=1, tid=2, ts=410, dur=20, name="fusion.3"),
              dict(ph="X", pid=1, tid=2, ts=350, dur=4, name="copy.1")]
    (tmp_path / "run").mkdir()
    with gzip.open(tmp_path / "run" / "perfetto_trace.json.gz", "wt") as f:
        json.dump(dict(traceEvents=meta + events), f)
    times = {name: (ms, n) for name, ms, n in prof.device_op_times(str(tmp_path), calls=1)}
    assert times == {"jit_prefill | fusion.3": (0.05, 1), "jit__steps | fusion.3": (0.04, 2), "copy.1": (0.004, 1)}


@pytest.mark.slow
@pytest.mark.e2e
def test_bench_train_tpu_cpu_smoke_prints_rows():
    """scripts/bench_train_tpu.py --cpu-smoke --find-largest: the training step with ringsplash's attention and the
    three swapped in (jax.nn.dot_product_attention, JAX's splash interpreted) all run, their first losses agree
    (the same batch and initialisation: the injected attention computes the same function), MFU is printed
    against the given peak, and the largest-shape search reports a row."""
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_train_tpu.py"), "--cpu-smoke", "--find-largest",
         "--peak-tflops", "0.5", "--log", os.devnull, "--strategies", "ring"],
        capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert ("| row | attention | model (layers x d_model) | S | batch | step ms | tokens/s | TF/s | MFU | first loss "
            "| note |") in out
    assert "FLOPs per step = 6·(N + d_model·V)·B·S + 3·L·4·H·dh·B·S(S+1)/2" in out and "not a TPU speed" in out
    rows = {c[1]: c for c in map(_cells, out.splitlines()) if c[0] == "(a)/(c)"}
    assert set(rows) == {"ringsplash", "ringsplash-noseg", "xla", "jax-splash"}, out
    losses = {name: float(c[9]) for name, c in rows.items()}
    for name, c in rows.items():
        assert float(c[5]) > 0 and c[8].endswith("%") and not c[10], c  # step ms, MFU, no error note
        assert abs(losses[name] - losses["ringsplash"]) < 2e-3 * losses["ringsplash"], losses
    ring = next(c for c in map(_cells, out.splitlines()) if c[0] == "(a)" and c[1] == "ringsplash ring")
    assert float(ring[5]) > 0 and not ring[10], ring  # the model trained over the ring (one-device mesh)
    assert abs(float(ring[9]) - losses["ringsplash"]) < 2e-3 * losses["ringsplash"], (ring, losses)
    largest = next(c for c in map(_cells, out.splitlines()) if c[0] == "(b) largest")
    assert largest[3] == "512" and float(largest[5]) > 0 and "layers tried: 2: fits" in largest[10], largest


@pytest.mark.slow
@pytest.mark.e2e
def test_bench_inference_tpu_cpu_smoke_prints_rows():
    """scripts/bench_inference_tpu.py --cpu-smoke: prefill and decode rows for the MHA and GQA models at batch 1
    and 2, one step per program and 4 (prefill timed in the first), each shape compiled once (prefill and
    decode) and never during the timed calls, MFU and the roofline printed against the given peak and bandwidth,
    and generate's own time per token."""
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_inference_tpu.py"), "--cpu-smoke", "--peak-tflops", "0.5",
         "--hbm-gbps", "20", "--steps-per-program", "1,4", "--generate-tokens", "4", "--log", os.devnull],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert ("| model | prompt | batch | prefill s | prefill TF/s | prefill MFU | decode ms/step | decode tokens/s "
            "| roofline ms/step | % of roofline | compiles (prefill, decode) | note |") in out
    rows = [c for c in map(_cells, out.splitlines()) if c[0].startswith(("mha (", "gqa ("))]
    assert [(c[0].split()[0], c[1], c[2]) for c in rows] == [
        (m, "256", b) for m in ("mha", "gqa") for b in ("1", "2") for _ in range(2)], out
    for i, c in enumerate(rows):
        first = i % 2 == 0  # one step per program, the prefill timed; then 4 steps per program
        assert float(c[6]) > 0 and c[9].endswith("%"), c
        assert (float(c[3]) > 0 and c[5].endswith("%")) if first else c[3] == "-", c
        assert c[10] == ("1, 1" if first else "0, 1"), c  # one compile per shape each, nothing recompiled
        generate = r"generate: ([0-9.]+ ms/token \(\d+% of roofline\)|below timing noise)"  # CPU: noise
        assert re.fullmatch(("" if first else "4 steps per program; ") + generate, c[11]), c


def test_bench_splash_tpu_rounds_alternate_the_order_and_keep_each_entrys_fastest():
    """bench_splash_tpu.measure_row (the chip's row loop, here with a fake measurement): with --rounds 2 every
    entry runs twice, the second round in reverse order; each keeps its fastest round, an implementation its
    fastest candidate; failures are dropped, a default that never ran reports its error."""
    bench = _script("bench_splash_tpu")
    times = {("ringsplash", None): [2.3, 1.2], ("jax", "a"): [1.5, 1.4], ("jax", "b"): [1.3, 1.6],
             ("tokamax", "a"): [None, None]}
    calls = []

    def measure_one(impl, cand):
        calls.append((impl, cand))
        ms = times[impl, cand][sum(c == (impl, cand) for c in calls) - 1]
        return ms, "" if ms is not None else "boom"

    candidates = {"jax": ["a", "b"], "tokamax": ["a"]}
    result = bench.measure_row(measure_one, candidates, rounds=2)
    first = [("ringsplash", None), ("jax", "a"), ("jax", "b"), ("tokamax", "a")]
    assert calls == first + first[::-1]
    assert result.default == 1.2 and result.default_spread == pytest.approx(2.3 / 1.2)
    assert result.best == {"jax": (1.3, "b"), "tokamax": (None, None)}
    one = bench.measure_row(lambda impl, cand: (None, "VMEM") if impl == "ringsplash" else (1.0, ""), candidates, 1)
    assert one.default is None and one.default_error == "VMEM" and one.best["jax"] == (1.0, "a")
    with pytest.raises(ValueError, match="--rounds must be at least 1, got 0"):
        bench.measure_row(measure_one, candidates, rounds=0)
    # ringsplash's own candidates: its best is the fastest candidate, never the default entry (which has no
    # blocks to print) even when the default is faster (the chip run of 2026-12-06 crashed printing it)
    own = bench.measure_row(lambda impl, cand: (1.0 if cand is None else 2.0, ""), {"ringsplash": ["x"]}, 1)
    assert own.default == 1.0 and own.best == {"ringsplash": (2.0, "x")}


def test_bench_splash_tpu_back_to_back_times_each_call_once_per_burst(monkeypatch):
    """bench_splash_tpu.timed: with --back-to-back N each sample dispatches N calls and blocks once; the time
    per call is the sample over N (a fake clock: every call takes 2 ms, a block 1 ms more)."""
    import time

    bench = _script("bench_splash_tpu")
    clock = {"t": 0.0, "calls": 0, "blocks": 0}

    def fn(x):
        clock["t"] += 2e-3
        clock["calls"] += 1
        return x

    def block(x):
        clock["t"] += 1e-3
        clock["blocks"] += 1
        return x

    monkeypatch.setattr(time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(bench.jax, "block_until_ready", block)
    assert bench.timed(fn, (1,), repeats=3, back_to_back=4) == pytest.approx(2.25)
    assert clock["calls"] == 1 + 3 * 4 and clock["blocks"] == 1 + 3  # the compile call, then one block a sample
    assert bench.timed(fn, (1,), repeats=3) == pytest.approx(3.0)


def test_bench_decode_tpu_pages_hold_the_same_cache():
    """bench_decode_tpu.rpa_inputs: ragged_paged_attention's pages hold the cache the kernel reads: JAX's own
    reference of ragged_paged_attention on them equals the dense decode oracle on the cache (float32; 2.4e-7
    measured, 2026-12-07)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    from ringsplash.inference.decode_kernel import decode_attention_reference

    bench = _script("bench_decode_tpu")
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 4, 128, 64))
    q = q[:, :, 0]  # [batch 2, heads 4, d]
    k, v = k[:, :2], v[:, :2]  # [batch 2, kv_heads 2, 128 slots, d]
    lengths = jnp.array([100, 37], jnp.int32)
    out = ref_ragged_paged_attention(q, *bench.rpa_inputs(k, v, lengths, 32), sm_scale=64**-0.5)
    np.testing.assert_allclose(out, decode_attention_reference(q, k, v, lengths)[0], atol=2e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.e2e
def test_bench_decode_tpu_cpu_smoke_prints_both_tables():
    """scripts/bench_decode_tpu.py --cpu-smoke --models gqa with two block budgets: the kernel-alone row (the TPU
    interpreter; no peer on the CPU; the faster budget) and a generate row per budget (ms per token, the roofline
    against the given bandwidth, the budget's block in the note)."""
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_decode_tpu.py"), "--cpu-smoke", "--models", "gqa",
         "--block-bytes", "65536,4194304", "--peak-tflops", "0.5", "--hbm-gbps", "20", "--log", os.devnull],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "| model | prompt | batch | cache slots | ours ms | block | ragged_paged_attention ms |" in out
    assert "| model | prompt | batch | cache slots | 1 token s | prefill MFU (lower bound) | ms / token |" in out
    rows = [c for c in map(_cells, out.splitlines()) if c[0] in ("mha", "gqa")]
    assert [(c[0], c[1], c[2], c[3]) for c in rows] == [("gqa", "200", "2", "384")] * 3, out
    attention, generate, generate_4mib = rows
    assert "0.0625 MiB budget: 128-slot blocks" in generate[11] and "4 MiB budget: 384-slot blocks" in generate_4mib[11]
    assert float(attention[4]) > 0 and attention[5] in ("128", "384") and "not a TPU speed" in attention[10], attention
    assert float(generate[4]) > 0 and generate[5].endswith("%") and float(generate[8]) > 0, generate
    # the streamed roofline (no input embedding table) is the tighter bound: at most the roofline's %
    assert generate[10].endswith("%") and float(generate[10][:-1]) <= float(generate[9][:-1]), generate
    assert "not a TPU speed" in generate[11], generate


@pytest.mark.slow
@pytest.mark.e2e
def test_bench_context_parallel_tpu_cpu_smoke_times_and_checks_each_strategy():
    """scripts/bench_context_parallel_tpu.py --cpu-smoke: a forward row and a forward+backward row (packed documents),
    each strategy's ms beside Splash's, and the row's largest difference from Splash's outputs and gradients (on the
    CPU the one-device strategies give Splash's numbers exactly)."""
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_context_parallel_tpu.py"), "--cpu-smoke", "--strategies",
         "splash,ring,ulysses", "--repeats", "1", "--back-to-back", "1", "--log", os.devnull],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "| row | splash ms | ring ms (x splash) | ulysses ms (x splash) | largest abs diff from splash |" in proc.stdout
    rows = [c for c in map(_cells, proc.stdout.splitlines()) if c[0].endswith(("fwd", "fwd+bwd"))]
    assert [c[0] for c in rows] == ["causal 1K fwd", "16 docs 1K fwd+bwd"], proc.stdout
    for cells in rows:
        assert float(cells[1]) > 0 and all(re.fullmatch(r"[0-9.]+ \([0-9.]+x\)", c) for c in cells[2:4]), cells
        diff, strategy = cells[4].split()
        assert float(diff) == 0.0 and strategy in ("(ring)", "(ulysses)"), cells


def test_model_context_parallel_prints_a_pick_per_row(capsys):
    """scripts/model_context_parallel.py: one row per (S, chips) with each strategy's modelled ms and the pick; the
    ring's compute term is the measured block time x the busiest device's blocks (4 chips at 128K: causal zigzag
    work splits evenly, so about a quarter of one chip's 256 x 257 / 2 blocks x 32 heads)."""
    spec = importlib.util.spec_from_file_location("model_context_parallel", ROOT / "scripts" / "model_context_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--seq", "128K", "--chips", "4,8"])
    rows = [c for c in map(_cells, capsys.readouterr().out.splitlines()) if c and c[0] == "128K"]
    assert [r[1] for r in rows] == ["4", "8"], rows
    one_chip_ms = 32 * 256 * 257 / 2 * module.V5E_BLOCK_US * 1e-3
    assert 0.24 * one_chip_ms <= float(rows[0][2]) <= 0.27 * one_chip_ms, rows[0]
    assert all(r[6] in ("ring", "all-gather", "Ulysses", "USP") for r in rows), rows
