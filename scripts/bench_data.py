"""Benchmark: tokenizing corpora and the packing loader, against what a training step consumes.

On a corpus built from the Python standard library's ``.py`` files (~4 MB of text) it prints:

1. tokenize throughput (MB of input text per second): bytes, and a Hugging Face BPE
   tokenizer (vocabulary ``--vocab``, trained here on the same text by ``tokenizers``);
2. loader throughput: packed tokens per second one process reads through ``data.Loader``'s
   Grain iterator (``--threads`` reader threads, prefetching), per packing policy and ``seq_len``;
3. what a training step consumes: tokens per second of ``train.fit`` fed by that loader (a tiny
   model: ``--d-model``, 2 layers, splash ``backend="xla"``, CPU), and the ratio loader / step.
   The loader should be >= 10x the step. ``--step-tokens-per-s`` compares against a rate measured
   elsewhere (e.g. a TPU run's ``tokens_per_s``) instead.

CPU timings on a shared machine: medians of ``--repeats`` runs; the step rate is this CPU's,
never a TPU speed.

    python scripts/bench_data.py                          # 8K and 32K
    python scripts/bench_data.py --seqs 8192 --batches 64 --step-tokens-per-s 2e6
"""

import argparse
import glob
import os
import statistics
import sys
import sysconfig
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench import fmt_tokens, md_table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768], help="row lengths (default %(default)s)")
    p.add_argument("--rows", type=int, default=8, help="rows per batch read by the process (default %(default)s)")
    p.add_argument("--batches", type=int, default=16, help="batches timed per loader run (default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="loader reader threads (default %(default)s)")
    p.add_argument("--policies", nargs="+", default=["concat_split", "best_fit"],
                   help="packing policies timed (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; medians (default %(default)s)")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary of the HF tokenizer (default %(default)s)")
    p.add_argument("--files", type=int, default=0, help="stdlib files in the corpus; 0 = all (default %(default)s)")
    p.add_argument("--d-model", type=int, default=64, help="width of the tiny model timed (default %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="training steps timed, after one to compile (default %(default)s)")
    p.add_argument("--step-tokens-per-s", type=float, default=0.0,
                   help="0 = measure the step here; else compare with this rate (default %(default)s)")
    p.add_argument("--workdir", default="", help='"" = a temporary directory for the corpora and runs')
    return p


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def tokenize_rows(files: list[str], work: str, vocab: int, repeats: int) -> tuple[list[dict], str]:
    """Tokenize throughput rows, and the bytes corpus directory."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from ringsplash import data

    mb = sum(os.path.getsize(f) for f in files) / 1e6
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]"], show_progress=False))
    tok_path = os.path.join(work, "tokenizer.json")
    tok.save(tok_path)
    rows = []
    for name, spec in (("bytes", "bytes"), (f"HF BPE {vocab}", tok_path)):
        out = os.path.join(work, f"corpus-{name.split()[0].lower()}")
        options = data.TokenizeOptions(tokenizer=spec, errors="replace")

        def run(out=out, options=options):
            shutil.rmtree(out, ignore_errors=True)
            data.tokenize_corpus(files, out, options, progress=False)

        t = _median_time(run, repeats)
        m = data.read_manifest(out)
        rows.append({"tokenizer": name, "MB": f"{mb:.1f}", "tokens": m["num_tokens"], "s": f"{t:.2f}",
                     "MB/s": f"{mb / t:.1f}", "tokens/s": f"{m['num_tokens'] / t:.3g}"})
    return rows, os.path.join(work, "corpus-bytes")


def loader_rate(corpus: str, seq: int, rows: int, batches: int, policy: str, threads: int, repeats: int) -> float:
    """Packed tokens per second one process reads (its ``rows`` of each batch) through the iterator."""
    from ringsplash import data

    loader = data.Loader(corpus, data.LoaderConfig(seq_len=seq, batch_size=rows, packing=policy,
                                                   num_threads=threads, prefetch=2 * threads))
    start = [0]

    def run():
        it = loader.iterator(list(range(rows)), step=start[0])
        for _ in range(batches):
            next(it)
        start[0] += batches

    return batches * rows * seq / _median_time(run, repeats)


def step_rate(corpus: str, seq: int, d_model: int, steps: int, work: str) -> float:
    """Tokens per second ``train.fit`` trains at, fed by the loader (median over the timed steps)."""
    from ringsplash import data, train
    from ringsplash.model import TransformerConfig
    from ringsplash.splash import SplashConfig

    blocks = SplashConfig(block_q=512, block_kv=512, block_q_dkv=512, block_kv_dkv=512, backend="xla")
    config = TransformerConfig(vocab_size=256, d_model=d_model, num_layers=2, num_heads=2, max_seq_len=seq,
                               splash=blocks)
    tc = train.TrainConfig(steps=steps + 1, batch_size=1, warmup_steps=1, log_every=1, progress=False)
    loader = data.Loader(corpus, data.LoaderConfig(seq_len=seq, batch_size=1))
    run_dir = os.path.join(work, f"run-{seq}")
    train.fit(config, tc, loader, run_dir, resume=False, mesh=train.make_mesh(1, 1))
    rates = [r["tokens_per_s"] for r in train.MetricsLog(run_dir).read() if "tokens_per_s" in r]
    return statistics.median(rates)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    files = files[: args.files] if args.files else files
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or tmp
        os.makedirs(work, exist_ok=True)
        tok_rows, corpus = tokenize_rows(files, work, args.vocab, args.repeats)
        print("tokenize (one process; HF tokenizers encode batches on their own thread pool):")
        print(md_table(tok_rows, ["tokenizer", "MB:", "tokens:", "s:", "MB/s:", "tokens/s:"]), flush=True)
        load_rows = []
        for seq in args.seqs:
            step = args.step_tokens_per_s or step_rate(corpus, seq, args.d_model, args.steps, work)
            for policy in args.policies:
                rate = loader_rate(corpus, seq, args.rows, args.batches, policy, args.threads, args.repeats)
                load_rows.append({"seq_len": fmt_tokens(seq) if seq >= 1024 else str(seq), "packing": policy, "loader tokens/s": f"{rate:.3g}",
                                  "step tokens/s": f"{step:.3g}", "loader / step": f"{rate / step:.1f}x"})
        source = "given" if args.step_tokens_per_s else f"measured: train.fit, d_model {args.d_model}, CPU"
        print(f"\nloader (one process, {args.rows} rows a batch, {args.threads} threads) vs a training step ({source}):")
        print(md_table(load_rows, ["seq_len", "packing", "loader tokens/s:", "step tokens/s:", "loader / step:"]))
    return {"tokenize": tok_rows, "loader": load_rows}


if __name__ == "__main__":
    main()
