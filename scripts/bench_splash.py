"""Benchmark: the Pallas Splash kernels.

For S in {8K, 32K, 128K} x {causal, local window 4096, chunked causal 8192}, 8 heads,
head_dim 128, bfloat16, blocks 512 x 512 (forward, dq and dK/dV), this prints markdown tables:

1. active-block FLOPs (MaskInfo ``num_active`` x 4·bq·bkv·d per head, forward; backward
   counted as 2.5x forward) against dense FLOPs, and their ratio;
2. scalar-prefetch (SMEM) work-list bytes per Pallas kernel (forward, dq, dK/dV), per device;
3. compiled TPU temporary memory of the forward and of forward+backward (``jit(grad)``) for
   v5e and v6e (one device of ``get_topology_desc("v5e:2x2" / "v6e:2x2", "tpu")``, compiled
   from this CPU machine through libtpu), compile times, and pass/fail against the
   limit 2 x |q| float32; compile errors are printed verbatim, not hidden;
4. Pallas *interpreter* time on CPU (``backend="interpret"``) of the forward at S = 8K,
   causal: interpreter time, never a TPU speed;
5. the table of ``scripts/bench_splash_xla.py`` (``backend="xla"`` vs
   ``jax.nn.dot_product_attention`` on this CPU), run as a subprocess
   (``--skip-cpu-timing`` leaves it out).

    python scripts/bench_splash.py                     # everything (~5-12 min on 2 shared cores)
    python scripts/bench_splash.py --skip-cpu-timing   # tables 1-4 only (~2 min)
    python scripts/bench_splash.py --quick             # S=8K, causal, v5e; no CPU timings

Nothing here runs on a TPU: the memory numbers are the compiler's, the times are this CPU's.
"""

import os

for _key, _value in {
    "JAX_PLATFORMS": "cpu",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_ACCELERATOR_TYPE": "v5litepod-4",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}.items():
    os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ringsplash as rs  # noqa: E402
from ringsplash import aot, masks  # noqa: E402

SIZES = {"8K": 8192, "32K": 32768, "128K": 131072}
MASKS = {
    "causal": ("causal", lambda s: masks.CausalMask((s, s))),
    "local": ("local 4096", lambda s: masks.LocalMask((s, s), window=(4096, 0))),
    "chunked": ("chunked 8192", lambda s: masks.ChunkedCausalMask((s, s), 8192)),
}
TARGETS = ("v5e:2x2", "v6e:2x2")
HEADS, HEAD_DIM, BLOCK = 8, 128, 512
BWD_FACTOR = 2.5  # backward FLOPs ~ 2.5 x forward (dq: 3 matmuls, dK/dV: 4, vs forward's 2)
INTERPRET_S, INTERPRET_REPEATS = 8192, 3
# bench_splash_xla.py rows: S -> repeats (dense at 8K takes 20-70 s and ~11 GiB per run here)
CPU_ROWS = {4096: 3, 8192: 3}
DENSE_RSS_GIB = {4096: 3.5, 8192: 12.0}  # peak RSS of one dense row, measured on this machine
MiB = 2**20


def _fmt_err(exc: BaseException, limit: int = 600) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}{' ...' if len(text) > limit else ''}"


def _config() -> rs.SplashConfig:
    return rs.SplashConfig(block_q=BLOCK, block_kv=BLOCK, block_q_dkv=BLOCK, block_kv_dkv=BLOCK,
                           backend="mosaic_tpu")


def _functions(mask, config):
    attn = functools.partial(rs.splash_attention, mask=mask, config=config)

    def loss(q, k, v, w):  # w is an input, so nothing about d_out folds into constants
        return jnp.vdot(attn(q, k, v).astype(jnp.float32), w.astype(jnp.float32))

    return attn, jax.grad(loss, argnums=(0, 1, 2))


# ----------------------------------------------------------------------------------------
# 1. FLOPs


def flops_row(s: int, mask) -> dict:
    info = rs.build_mask_info(mask, (BLOCK, BLOCK))
    per_list = info.num_active.reshape(info.num_active.shape[0], -1).sum(axis=1)
    h2l = np.broadcast_to(info.head_to_list, (HEADS,)) if info.head_to_list.shape[0] == 1 else info.head_to_list
    active = int(per_list[h2l].sum())  # over heads
    total = HEADS * (s // BLOCK) ** 2
    fwd = active * 4 * BLOCK * BLOCK * HEAD_DIM
    dense = HEADS * 4 * s * s * HEAD_DIM
    return dict(active=active // HEADS, total=total // HEADS, fwd=fwd, dense=dense)


def print_flops(rows):
    print("### 1. Active-block FLOPs vs dense (8 heads, d=128, blocks 512x512; backward ~ 2.5x forward)\n")
    print("| S | mask | active / total blocks (per head) | fwd TFLOP active | fwd TFLOP dense "
          "| bwd TFLOP active | bwd TFLOP dense | active / dense |")
    print("|---|---|---|---|---|---|---|---|")
    for (size, label), r in rows:
        t = 1e12
        print(f"| {size} | {label} | {r['active']} / {r['total']} | {r['fwd'] / t:.3f} | {r['dense'] / t:.3f} "
              f"| {BWD_FACTOR * r['fwd'] / t:.3f} | {BWD_FACTOR * r['dense'] / t:.3f} | {r['fwd'] / r['dense']:.4f} |")
    print(flush=True)


# ----------------------------------------------------------------------------------------
# 2. scalar prefetch (SMEM) per kernel


def _pallas_calls(jaxpr, out):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            n = eqn.params["grid_mapping"].num_index_operands
            sizes = [int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in eqn.invars[:n]]
            out.append((str(eqn.params.get("name", "?")), sum(sizes), max(sizes, default=0)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                if hasattr(sub, "eqns"):
                    _pallas_calls(sub, out)
                elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    _pallas_calls(sub.jaxpr, out)
    return out


def prefetch_row(s: int, mask) -> list:
    _, grad = _functions(mask, _config())
    q = jax.ShapeDtypeStruct((HEADS, s, HEAD_DIM), jnp.bfloat16)
    return _pallas_calls(jax.make_jaxpr(grad)(q, q, q, q).jaxpr, [])


def print_prefetch(rows):
    print("### 2. Scalar-prefetch (SMEM) work lists per device, per Pallas kernel "
          "(total bytes; largest single operand in parentheses)\n")
    names = []
    for _, kernels in rows:
        for name, _, _ in kernels if isinstance(kernels, list) else []:
            if name not in names:
                names.append(name)
    print("| S | mask | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for (size, label), kernels in rows:
        if isinstance(kernels, str):
            print(f"| {size} | {label} | " + " | ".join(["error"] * len(names)) + " |")
            continue
        by_name = {n: (t, m) for n, t, m in kernels}
        cells = [f"{by_name[n][0] / 1024:.1f} KiB ({by_name[n][1] / 1024:.1f} KiB)" if n in by_name else "-"
                 for n in names]
        print(f"| {size} | {label} | " + " | ".join(cells) + " |")
    print(flush=True)


# ----------------------------------------------------------------------------------------
# 3. TPU compiles


def compile_row(target: str, s: int, mask) -> dict:
    attn, grad = _functions(mask, _config())
    sharding = jax.sharding.SingleDeviceSharding(aot.topology_devices(target)[0])
    q = jax.ShapeDtypeStruct((HEADS, s, HEAD_DIM), jnp.bfloat16, sharding=sharding)
    row = dict(limit=2 * HEADS * s * HEAD_DIM * 4)
    for key, fn, args in (("fwd", attn, (q, q, q)), ("bwd", grad, (q, q, q, q))):
        t0 = time.perf_counter()
        try:
            row[key] = aot.compile_report(fn, *args).temp
        except Exception as exc:
            row[key] = None
            row[key + "_error"] = _fmt_err(exc)
        row[key + "_s"] = time.perf_counter() - t0
    return row


def print_compile(rows, failures):
    print("### 3. Compiled TPU temporary memory (one device; bf16, 8 heads, d=128, blocks 512)\n")
    print("Limit: 2 x |q| in float32 applied to forward+backward. Compile times "
          "include lowering; compiled from this CPU through libtpu. Temp = HBM temporaries from "
          "`compiled.memory_analysis().temp_size_in_bytes`; buffers that XLA's memory-space assignment "
          "places in VMEM (at 8K it moves the residuals and copies of q, k, v, d_out there) are not "
          "counted, so a small or zero number means nothing spilled to HBM.\n")
    print("| target | S | mask | fwd temp MiB | fwd compile s | fwd+bwd temp MiB | fwd+bwd compile s "
          "| limit MiB | fwd+bwd <= limit |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (target, size, label), r in rows:
        cells = []
        for key in ("fwd", "bwd"):
            if r[key] is None:
                failures.append(f"{target} S={size} {label} {'forward' if key == 'fwd' else 'forward+backward'}: "
                                f"{r[key + '_error']}")
                cells += [f"ERROR [{len(failures)}]", f"{r[key + '_s']:.1f}"]
            else:
                cells += [f"{r[key] / MiB:.2f}", f"{r[key + '_s']:.1f}"]
        verdict = "n/a (error)" if r["bwd"] is None else ("pass" if r["bwd"] <= r["limit"] else "FAIL")
        print(f"| {target} | {size} | {label} | " + " | ".join(cells) + f" | {r['limit'] / MiB:.0f} | {verdict} |")
    print(flush=True)


# ----------------------------------------------------------------------------------------
# 4. interpreter time


def print_interpret(heads: int):
    s = INTERPRET_S
    print("### 4. Pallas interpreter time on CPU — not a TPU speed\n")
    print(f"backend='interpret' forward, S={s // 1024}K causal, {heads} head(s) "
          f"(of the 8 in the tables above), d=128, bf16, blocks 512; median of {INTERPRET_REPEATS} runs "
          f"after one compile, on this shared {os.cpu_count()}-core CPU.\n")
    mask = masks.CausalMask((s, s))
    cfg = rs.SplashConfig(block_q=BLOCK, block_kv=BLOCK, backend="interpret")
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (heads, s, HEAD_DIM), jnp.bfloat16) for key in keys)
    fn = jax.jit(functools.partial(rs.splash_attention, mask=mask, config=cfg))
    t0 = time.perf_counter()
    compiled = fn.lower(q, k, v).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(INTERPRET_REPEATS):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - t0)
    print("| what | S | mask | heads | compile s | median s (interpreter, CPU) | runs s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| Pallas interpreter time on CPU — not a TPU speed | {s // 1024}K | causal | {heads} | {compile_s:.2f} "
          f"| {statistics.median(times):.2f} | {', '.join(f'{t:.2f}' for t in times)} |")
    print(flush=True)


# ----------------------------------------------------------------------------------------
# 5. bench_splash_xla.py


def _mem_available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def run_cpu_timing(rows_by_size: dict[int, int]):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_splash_xla.py")
    print("### 5. backend='xla' vs jax.nn.dot_product_attention on this CPU (scripts/bench_splash_xla.py)\n")
    if not os.path.exists(script):
        print(f"skipped: {script} not found\n", flush=True)
        return
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for s, repeats in rows_by_size.items():
        need, avail = DENSE_RSS_GIB.get(s), _mem_available_gib()
        if need is not None and avail is not None and avail < need:
            print(f"S={s}: skipped — the dense row needs ~{need:.0f} GiB and only {avail:.1f} GiB is "
                  f"available now (this machine is shared); rerun later or run bench_splash_xla.py alone.\n",
                  flush=True)
            continue
        cmd = [sys.executable, script, "--rows", f"{s}:causal", f"{s}:local", "--repeats", str(repeats)]
        print(f"`{' '.join(['python', 'scripts/bench_splash_xla.py'] + cmd[2:])}`\n\n```", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        sys.stdout.write(proc.stdout)
        if proc.returncode:
            tail = proc.stderr.strip().splitlines()[-3:]
            print(f"bench_splash_xla.py exited {proc.returncode}: {' | '.join(tail)}")
        print("```\n", flush=True)


# ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES),
                        help="sequence lengths (default: all)")
    parser.add_argument("--masks", nargs="*", default=list(MASKS), choices=list(MASKS), help="masks (default: all)")
    parser.add_argument("--targets", nargs="*", default=list(TARGETS),
                        help="TPU topologies to compile for (default: %(default)s)")
    parser.add_argument("--interpret-heads", type=int, default=1,
                        help="heads in the interpreter timing (default: %(default)s)")
    parser.add_argument("--skip-interpret", action="store_true", help="leave out the interpreter timing")
    parser.add_argument("--skip-cpu-timing", action="store_true", help="leave out bench_splash_xla.py's table")
    parser.add_argument("--quick", action="store_true",
                        help="S=8K, causal, v5e only; no interpreter or CPU timing (smoke test)")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.sizes, args.masks, args.targets = ["8K"], ["causal"], ["v5e:2x2"]
        args.skip_interpret = args.skip_cpu_timing = True

    print(f"# Splash kernels: bf16, {HEADS} heads, d={HEAD_DIM}, blocks {BLOCK}x{BLOCK} "
          f"(jax {jax.__version__}, {os.cpu_count()} CPU cores)\n", flush=True)
    cases = [(size, MASKS[m][0], MASKS[m][1](SIZES[size])) for size in args.sizes for m in args.masks]

    print_flops([((size, label), flops_row(SIZES[size], mask)) for size, label, mask in cases])

    prefetch = []
    for size, label, mask in cases:
        try:
            prefetch.append(((size, label), prefetch_row(SIZES[size], mask)))
        except Exception as exc:
            prefetch.append(((size, label), _fmt_err(exc)))
    print_prefetch(prefetch)

    failures: list[str] = []
    compiled = []
    t_all = time.perf_counter()
    for target in args.targets:
        for size, label, mask in cases:
            compiled.append(((target, size, label), compile_row(target, SIZES[size], mask)))
    print_compile(compiled, failures)
    for (size, label), kernels in prefetch:
        if isinstance(kernels, str):
            failures.append(f"scalar-prefetch trace S={size} {label}: {kernels}")
    if failures:
        print("Errors (verbatim, truncated to 600 characters):\n")
        for i, text in enumerate(failures, 1):
            print(f"{i}. {text}")
        print()
    print(f"(all TPU compiles: {time.perf_counter() - t_all:.0f} s)\n", flush=True)

    if args.skip_interpret:
        print("### 4. Pallas interpreter time on CPU — not a TPU speed\n\nskipped\n", flush=True)
    else:
        print_interpret(args.interpret_heads)

    if args.skip_cpu_timing:
        print("### 5. backend='xla' vs jax.nn.dot_product_attention on this CPU\n\nskipped\n", flush=True)
    else:
        run_cpu_timing(CPU_ROWS)


if __name__ == "__main__":
    main()
