"""Benchmark: Hugging Face checkpoints (``ringsplash.hf``) — load time and peak host memory,
whole vs sharded, and forward tokens/s of ringsplash vs transformers on the same imported model.

A random model of the ``--preset`` shape (default ``1b``: Llama 3.2 1B's shape, untied
embeddings), family llama, is created by one jitted init (materialised once) and written once by
``save_hf`` (``--dtype``, default bfloat16 on disk: half the bytes of float32) under ``--dir``.
Then, each row in a fresh process so its peak RSS is its own:

* load rows: ``load_hf(path)`` (float32 params) whole on 1 device; the same onto an FSDP mesh
  of 4 simulated CPU devices in one process (``train.make_mesh(4, 1)``); and the sharded load
  as P processes x D devices through ``scripts/launch_local.py`` (default 2x2 and 4x1): per
  process, seconds, bytes read (``rs.hf.bytes_read()``), peak RSS and RSS before loading;
* forward rows (one process): the imported model on random tokens, batch 1, float32, at each
  ``--seq-lens``: ringsplash (``attention="splash"``, ``SplashConfig(backend="xla")``: the
  block-sparse jnp path a CPU user runs; ``"reference"`` would materialise S x S scores per
  head) jitted and compiled ahead of time (compile excluded), then
  ``transformers.AutoModelForCausalLM.from_pretrained(path, dtype=float32, attn_implementation="sdpa")``
  under ``torch.no_grad()`` (warm-up: one call at 128 tokens, excluded); median of
  ``--repeats`` timed calls each; the max abs difference of the two logits on every
  ``--compare-stride``-th position (so both compute the same thing). The ringsplash model is
  freed before torch loads (one process, but never both models at once).

    python scripts/bench_hf.py                                  # everything, 1b, /tmp/bench_hf
    python scripts/bench_hf.py --sections load --layouts 4x1    # one part
    python scripts/bench_hf.py --keep --sections load           # keep the checkpoint for a later --reuse
    python scripts/bench_hf.py --reuse --sections forward --seq-lens 8192 --repeats 1
    python scripts/bench_hf.py --tiny --seq-lens 256            # the smoke run (tests/test_bench_scripts.py)

On the 2-core host a 1B float32 forward at 2K takes minutes per call and at 8K far longer: pick
``--seq-lens`` / ``--repeats`` to fit (the rows say how many runs each median is of).
"""

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import child_main, fmt_bytes, md_table, median_of, peak_rss_mib, run_child

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD_ENV = dict(JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1")
TORCH_WARMUP_TOKENS = 128


def _config(preset: str):
    from ringsplash.model.presets import preset as make

    return make(preset)


def write_child(preset: str, path: str, dtype: str) -> dict:
    """A random ``preset`` model (one jitted init) written by ``save_hf`` as ``dtype``."""
    import equinox as eqx
    import jax

    import ringsplash as rs
    from ringsplash.model import Transformer

    config = _config(preset)
    t0 = time.perf_counter()
    model = eqx.filter_jit(lambda k: Transformer(config, key=k))(jax.random.key(0))
    jax.block_until_ready(model)
    init_s = time.perf_counter() - t0
    params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    t0 = time.perf_counter()
    files = rs.hf.save_hf(model, path, dtype=dtype)
    save_s = time.perf_counter() - t0
    disk = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    return dict(params=int(params), init_s=init_s, save_s=save_s, files=len(files), disk_bytes=disk,
                peak_rss_mib=peak_rss_mib())


def _load(path: str, mesh) -> dict:
    import jax

    import ringsplash as rs

    before = peak_rss_mib()
    rs.hf.reset_bytes_read()
    t0 = time.perf_counter()
    model = rs.hf.load_hf(path, mesh=mesh)
    jax.block_until_ready(model)
    seconds = time.perf_counter() - t0
    leaves = jax.tree.leaves(model)
    held = 0
    for x in leaves:  # distinct slices this process's devices hold
        held += sum({tuple((s.start, s.stop) for s in sh.index): sh.data.nbytes for sh in x.addressable_shards}.values())
    return dict(process=jax.process_index(), processes=jax.process_count(), devices=len(jax.local_devices()),
                seconds=seconds, bytes_read=rs.hf.bytes_read(), held_bytes=held,
                model_bytes=sum(x.nbytes for x in leaves), rss_before_mib=before, peak_rss_mib=peak_rss_mib())


def load_child(path: str, devices: int) -> dict:
    """``load_hf`` in this fresh process: whole (``devices == 1``) or onto a ``devices`` FSDP mesh."""
    import jax

    if devices > 1:
        jax.config.update("jax_num_cpu_devices", devices)
    from ringsplash import train

    return _load(path, None if devices == 1 else train.make_mesh(devices, 1))


def mp_worker(path: str) -> None:
    """One process of the launcher rows (``ringsplash.distributed`` has initialised JAX)."""
    import jax

    from ringsplash import train

    result = _load(path, train.make_mesh(len(jax.devices()), 1))
    print("BENCH_HF " + json.dumps(result), flush=True)


def _timed(fn, repeats: int):
    """(the last result, median seconds, all seconds) of ``repeats`` calls of ``fn()``."""
    out = [None]

    def call():
        out[0] = None  # free the previous result first (8K x vocab float32 logits are 4 GiB)
        out[0] = fn()

    med, runs = median_of(call, repeats)
    return out[0], med, runs


def forward_child(path: str, seq_lens: list[int], repeats: int, stride: int) -> dict:
    """ringsplash (splash, xla backend) then transformers (sdpa), same checkpoint, same tokens."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import ringsplash as rs

    rows = {S: {} for S in seq_lens}
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    model = rs.hf.load_hf(path, attention="splash", splash=rs.SplashConfig(backend="xla"))
    jax.block_until_ready(model)
    load_s = time.perf_counter() - t0
    if max(seq_lens) > model.config.max_seq_len:  # the preset's length is not a limit of its (plain) RoPE
        model = model.with_config(model.config.replace(max_seq_len=max(seq_lens)))
    vocab = model.config.vocab_size
    tokens = {S: rng.integers(0, vocab, S, dtype=np.int32) for S in seq_lens}
    params, static = eqx.partition(model, eqx.is_array)
    fwd = jax.jit(lambda p, t, pos, static=static: eqx.combine(p, static)(t, pos))
    ours = {}
    for S in seq_lens:
        t, pos = jnp.asarray(tokens[S]), jnp.arange(S, dtype=jnp.int32)
        c0 = time.perf_counter()
        compiled = fwd.lower(params, t, pos).compile()
        compile_s = time.perf_counter() - c0
        last, med, runs = _timed(lambda c=compiled, a=(params, t, pos): jax.block_until_ready(c(*a)), repeats)
        ours[S] = np.asarray(last[::stride])
        rows[S]["ringsplash"] = dict(compile_s=compile_s, seconds=med, runs=runs, tokens_per_s=S / med)
        del last, compiled
        gc.collect()
    del model, params, static, fwd
    gc.collect()
    jax.clear_caches()
    rss_after_jax = peak_rss_mib()

    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    t0 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    torch_load_s = time.perf_counter() - t0
    with torch.no_grad():
        hf(torch.from_numpy(tokens[seq_lens[0]][:TORCH_WARMUP_TOKENS].astype(np.int64))[None])
        for S in seq_lens:
            ids = torch.from_numpy(tokens[S].astype(np.int64))[None]
            last, med, runs = _timed(lambda ids=ids: hf(ids).logits, repeats)
            theirs = last[0, ::stride].numpy()
            rows[S]["transformers"] = dict(seconds=med, runs=runs, tokens_per_s=S / med)
            rows[S]["max_abs_diff"] = float(np.max(np.abs(theirs - ours[S])))
            rows[S]["max_abs_logit"] = float(np.max(np.abs(theirs)))
            del last
    return dict(rows={str(S): r for S, r in rows.items()}, load_s=load_s, torch_load_s=torch_load_s,
                peak_rss_after_ringsplash_mib=rss_after_jax, peak_rss_mib=peak_rss_mib(),
                torch_threads=torch.get_num_threads(), torch=torch.__version__, transformers=transformers.__version__)


def run_launcher(path: str, processes: int, devices: int, timeout: float) -> list[dict] | str:
    env = {**os.environ, **CHILD_ENV}
    cmd = [sys.executable, os.path.join(HERE, "launch_local.py"), "--processes", str(processes), "--devices",
           str(devices), "--timeout", str(int(timeout)), os.path.abspath(__file__), "--", "--mp-worker", path]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    found = [json.loads(ln.split("BENCH_HF ", 1)[1]) for ln in r.stdout.splitlines() if "BENCH_HF " in ln]
    if r.returncode or len(found) != processes:
        tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
        return f"{processes}x{devices} failed (code {r.returncode}): {' / '.join(tail)[:300]}"
    for f in found:
        f["launcher_wall_s"] = wall
    return sorted(found, key=lambda f: f["process"])


def _load_cells(label: str, r: dict) -> list:
    share = r["bytes_read"] / r["model_bytes"] * r.get("disk_elem_bytes", 1)
    return [label, r["process"], f"{r['seconds']:.2f}", fmt_bytes(r["bytes_read"]), fmt_bytes(r["held_bytes"]),
            f"{share:.2f}", f"{r['rss_before_mib'] / 1024:.2f}", f"{r['peak_rss_mib'] / 1024:.2f}",
            f"{(r['peak_rss_mib'] - r['rss_before_mib']) / 1024:.2f}"]


def load_section(args, path: str, disk_itemsize: int) -> str:
    rows = []
    for layout in args.layouts:
        print(f"load {layout}", file=sys.stderr, flush=True)
        if layout in ("whole", "1x4"):
            devices = 1 if layout == "whole" else 4
            r = run_child([__file__, "--load-child", path, "--devices", devices], timeout=args.timeout,
                          env=CHILD_ENV, label=f"load {layout}")
            results = r if isinstance(r, str) else [r]
            label = "whole, 1 process x 1 device" if layout == "whole" else "FSDP, 1 process x 4 devices"
        else:
            p, d = (int(x) for x in layout.split("x"))
            results = run_launcher(path, p, d, args.timeout)
            label = f"FSDP, {p} processes x {d} device{'s' if d > 1 else ''}"
        if isinstance(results, str):
            rows.append([label, "—", results, "", "", "", "", "", ""])
            continue
        for r in results:
            # the bytes read are on-disk bytes (the stored dtype); held bytes are float32 params
            r["disk_elem_bytes"] = 4 / disk_itemsize
            rows.append(_load_cells(label, r))
    return md_table(rows, ["load", "process:", "seconds:", "read (GiB):", "held (GiB, f32):",
                           "share of checkpoint read:", "RSS before (GiB):", "peak RSS (GiB):",
                           "peak − before (GiB):"])


def forward_section(args, path: str) -> str:
    r = run_child([__file__, "--forward-child", path, "--seq-lens", *args.seq_lens, "--repeats", args.repeats,
                   "--compare-stride", args.compare_stride], timeout=args.timeout_forward, env=CHILD_ENV,
                  label="forward")
    if isinstance(r, str):
        return r
    rows = []
    for S in args.seq_lens:
        row = r["rows"][str(S)]
        ours, theirs = row["ringsplash"], row["transformers"]
        for name, x in (("ringsplash (splash, xla backend), jit", ours), ("transformers (sdpa), torch CPU", theirs)):
            rows.append([S, name, f"{x.get('compile_s', 0):.1f}" if "compile_s" in x else "—",
                         f"{x['seconds']:.1f}", " / ".join(f"{t:.1f}" for t in x["runs"]), f"{x['tokens_per_s']:.0f}",
                         f"{row['max_abs_diff']:.2e} (of logits up to {row['max_abs_logit']:.1f})"
                         if name.startswith("transformers") else ""])
        rows.append([S, "ringsplash / transformers", "", "", "", f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x",
                     ""])
    head = (f"load_hf (splash) {r['load_s']:.1f} s, from_pretrained {r['torch_load_s']:.1f} s; torch "
            f"{r['torch']} ({r['torch_threads']} threads), transformers {r['transformers']}; process peak RSS "
            f"{r['peak_rss_after_ringsplash_mib'] / 1024:.1f} GiB after the ringsplash rows, "
            f"{r['peak_rss_mib'] / 1024:.1f} GiB overall\n\n")
    return head + md_table(rows, ["S", "forward", "compile (s):", "median (s):", "runs (s)", "tokens/s:",
                                  "max abs logit diff vs ringsplash"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--load-child", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--mp-worker", help=argparse.SUPPRESS)
    parser.add_argument("--forward-child", help=argparse.SUPPRESS)
    parser.add_argument("--write-child", help=argparse.SUPPRESS)
    parser.add_argument("--preset", default="1b", help="model shape (ringsplash.model.presets) (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="the tiny preset (smoke run)")
    parser.add_argument("--dir", default="/tmp/bench_hf", help="where the checkpoint goes (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="dtype stored on disk (default: %(default)s); params load as float32")
    parser.add_argument("--sections", nargs="+", default=["load", "forward"], choices=["load", "forward"],
                        help="which tables: load (time, bytes read, peak RSS) and / or forward (tokens/s)")
    parser.add_argument("--layouts", nargs="+", default=["whole", "1x4", "2x2", "4x1"],
                        help="load rows: whole, 1x4 (one process, 4 devices), PxD via launch_local.py")
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[2048, 8192], help="forward lengths (tokens)")
    parser.add_argument("--repeats", type=int, default=2, help="timed forwards per row (median)")
    parser.add_argument("--compare-stride", type=int, default=64, help="compare logits on every N-th position")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per load row")
    parser.add_argument("--timeout-forward", type=float, default=7200, help="seconds for the forward process")
    parser.add_argument("--reuse", action="store_true",
                        help="use the checkpoint already under --dir (written by an earlier --keep run)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint (default: delete it at the end)")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.write_child:
        child_main(write_child)(args.preset, args.write_child, args.dtype)
        return
    if args.load_child:
        child_main(load_child)(args.load_child, args.devices)
        return
    if args.mp_worker:
        mp_worker(args.mp_worker)
        return
    if args.forward_child:
        child_main(forward_child)(args.forward_child, args.seq_lens, args.repeats, args.compare_stride)
        return
    if args.tiny:
        args.preset = "tiny"
    path = os.path.join(args.dir, args.preset)
    itemsize = 2 if args.dtype == "bfloat16" else 4
    load1 = os.getloadavg()[0]
    if args.reuse and os.path.isfile(os.path.join(path, "config.json")):
        out = [f"model: preset {args.preset!r} shape, llama, the checkpoint already in {path} (--reuse); "
               f"{os.cpu_count()} CPUs, load average {load1:.1f} at the start"]
    else:
        print(f"write {args.preset} -> {path}", file=sys.stderr, flush=True)
        shutil.rmtree(path, ignore_errors=True)
        w = run_child([__file__, "--write-child", path, "--preset", args.preset, "--dtype", args.dtype],
                      timeout=args.timeout, env=CHILD_ENV, label="write")
        if isinstance(w, str):
            raise RuntimeError(w)
        out = [f"model: preset {args.preset!r} shape, llama, {w['params'] / 1e9:.3f} B params, random (one jitted "
               f"init {w['init_s']:.1f} s); save_hf as {args.dtype}: {w['save_s']:.1f} s, {w['files']} file(s), "
               f"{fmt_bytes(w['disk_bytes'])} GiB on disk, writer peak RSS {w['peak_rss_mib'] / 1024:.2f} GiB; "
               f"{os.cpu_count()} CPUs, load average {load1:.1f} at the start"]
    try:
        if "load" in args.sections:
            table = load_section(args, path, itemsize)
            out.append(f"load_hf into float32 params, one fresh process (or launcher run) per row; load average "
                       f"{os.getloadavg()[0]:.1f} after\n\n" + table)
        if "forward" in args.sections:
            table = forward_section(args, path)
            out.append(f"forward, batch 1, float32, median of {args.repeats}; load average {os.getloadavg()[0]:.1f} "
                       f"after\n\n" + table)
    finally:
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)
    print("\n\n".join(out))


if __name__ == "__main__":
    main()
