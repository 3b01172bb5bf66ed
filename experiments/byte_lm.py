"""Language model over any tokenized corpus, with the loss reported by position in context.

Data: ``--data PATH``, a corpus directory written by ``scripts/tokenize_corpus.py`` (any
tokenizer; the model's vocabulary is the corpus's). The held-out loss is measured on documents
the model never trained on: one in ten of ``--data``'s documents, chosen by a hash of each
document's tokens (``ringsplash.data.is_held_out``) and never trained on; or, with ``--heldout
PATH``, a corpus of other documents (tokenized apart, with the same tokenizer), and then every
document of ``--data`` is trained on. By default, a byte-level corpus of text every machine has:
the Python standard library's own top-level ``.py`` files (``sysconfig``), one in ten held out by
file name (the same hash), tokenized once under ``--corpus-dir`` (re-running is a no-op).

Training rows are packed by ``ringsplash.data.Loader`` (``--packing``) with segment ids, so
attention never crosses documents, and positions restart per document piece. After training,
the held-out loss is reported by position in context (how many tokens of the same document
precede the prediction) as a table and a plot: does more context help?

Checkpoints: ``--checkpoint-every N`` under ``--run-dir``; the same command with the same
``--run-dir`` resumes from the newest checkpoint (after a kill, exactly where an uninterrupted
run would be), and a larger ``--steps`` continues a finished run further.

    python experiments/byte_lm.py                      # ring over 4 simulated CPU devices (one TPU: below)
    python experiments/byte_lm.py --attention splash --context-parallel 1 --compute-dtype bfloat16
    python experiments/byte_lm.py --checkpoint-every 50 --run-dir runs/byte   # resumable: rerun it to resume
    python scripts/tokenize_corpus.py my_texts/ runs/corpora/mine --tokenizer tokenizer.json
    python experiments/byte_lm.py --data runs/corpora/mine         # one in ten of its documents held out
    python scripts/tokenize_corpus.py my_heldout_texts/ runs/corpora/mine-heldout --tokenizer tokenizer.json
    python experiments/byte_lm.py --data runs/corpora/mine --heldout runs/corpora/mine-heldout
"""

import dataclasses
import glob
import os
import sys
import sysconfig
import time
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _runtime: the experiments' shared start-up
from _runtime import (
    COMPUTE_DTYPES,
    DTYPES,
    check_block,
    check_flags,
    check_loader_seed,
    choose_devices,
    compute_dtype,
    context_devices,
    continue_to,
    run_script,
    splash_config,
)
from ringsplash import distributed
from ringsplash.cli import parse_config


@dataclasses.dataclass(frozen=True)
class Config:
    data: str = ""  # a tokenized corpus directory (scripts/tokenize_corpus.py); "" = the Python stdlib, bytes
    #: the held-out corpus (other documents than --data's, same tokenizer); "" = a tenth of --data's
    #: documents, by a hash of each (never trained on); without --data, the stdlib's held-out tenth
    heldout: str = ""
    corpus_dir: str = "runs/corpora"  # where the default stdlib corpora are tokenized (once)
    packing: str = "best_fit"  # training rows: concat_split | first_fit | best_fit (ringsplash.data.packing)
    seq_len: int = 1024  # tokens per training row (packed documents)
    # model: --preset NAME (ringsplash.model.presets) takes a preset's shape, any field still
    # overridable by its own flag; the vocabulary is the corpus's
    preset: str = ""  # a ringsplash.model.presets name; "" = the model fields below
    d_model: int = 128  # model width
    num_layers: int = 3  # transformer layers
    num_heads: int = 4  # query heads
    num_kv_heads: int = 0  # key/value heads (GQA); 0 = auto: num_heads
    head_dim: int = 0  # 0 = auto: d_model // num_heads
    mlp_ratio: float = 8 / 3  # SwiGLU hidden width / d_model (rounded up to mlp_multiple)
    mlp_multiple: int = 8  # the SwiGLU hidden width is a multiple of this
    rope_theta: float = 10_000.0  # RoPE base frequency
    remat: str = "none"  # rematerialisation of each layer: none | full | save_attention | save_dots
    attention: str = "ring"  # reference | splash (one device) | ring (over context_parallel devices)
    layout: str = "zigzag"  # token layout over the ring: contiguous | zigzag | striped
    backend: str = "auto"  # Splash backend: auto (mosaic_tpu on a TPU, xla elsewhere) | mosaic_tpu | interpret | xla
    block: int = 0  # Splash block size (tokens, a multiple of 128), every block of the kernels; 0 = auto: tuned
    param_dtype: str = "float32"  # parameter (master weight) dtype: float32 | bfloat16 | float16
    #: compute dtype of activations and matmuls: float32 | bfloat16 | float16 | auto (bfloat16 on a TPU,
    #: float32 elsewhere: _runtime.compute_dtype)
    compute_dtype: str = "auto"
    data_parallel: int = 1  # devices on the mesh's data axis (batch rows)
    #: devices on the ring (attention="ring" only; otherwise 1); 0 = auto: 4 simulated devices on the CPU,
    #: every device (over --data-parallel) on a TPU
    context_parallel: int = 0
    steps: int = 300  # training steps
    batch_size: int = 8  # global rows per step
    learning_rate: float = 2e-3  # peak AdamW learning rate (warmup, then cosine decay)
    warmup_steps: int = 30  # linear warmup steps
    eval_batches: int = 4  # held-out batches for the loss-by-position table
    seed: int = 0  # seed of the parameters and the data
    run_dir: str = ""  # "" = auto: runs/byte_lm/<time>; resumed when it holds a checkpoint
    checkpoint_every: int = 0  # steps between checkpoints; 0 = a checkpoint only at the end
    log_every: int = 10  # steps between training-metric lines
    progress: bool = True  # show a progress bar

    def __post_init__(self):
        """Option strings checked at once, each error naming its flag (the library configs check the rest)."""
        from ringsplash.data.packing import POLICIES
        from ringsplash.layouts import LAYOUTS
        from ringsplash.model.config import REMAT_POLICIES, STRATEGIES
        from ringsplash.splash.config import BACKENDS

        check_flags(self, choices={"remat": REMAT_POLICIES, "attention": STRATEGIES, "layout": LAYOUTS,
                                   "backend": BACKENDS, "packing": POLICIES, "param_dtype": DTYPES,
                                   "compute_dtype": COMPUTE_DTYPES},
                    positive=("seq_len", "d_model", "num_layers", "num_heads", "mlp_multiple", "data_parallel",
                              "steps", "batch_size", "eval_batches", "log_every"),
                    non_negative=("num_kv_heads", "head_dim", "warmup_steps", "checkpoint_every", "context_parallel",
                                  "seed"),
                    positive_numbers=("mlp_ratio", "rope_theta"), non_negative_numbers=("learning_rate",))
        check_block(self)
        check_loader_seed(self)
        if self.data and self.heldout and os.path.abspath(self.heldout) == os.path.abspath(self.data):
            raise ValueError(f"--heldout {self.heldout!r} is --data itself: pass a corpus of other documents")


def parse_args(argv=None) -> Config:
    from ringsplash.model.presets import PRESETS

    return parse_config(Config, argv, description=__doc__, presets=PRESETS)


def model_config(config: Config, vocab_size: int = 256):
    """The ``TransformerConfig`` of ``config`` (``vocab_size``: the corpus's; 256 for bytes)."""
    from ringsplash.model import ContextParallel, TransformerConfig

    cp = ContextParallel(layout=config.layout)
    cp = cp.on_axis(None, context_devices(config), "ring") if config.attention == "ring" else cp.single_device(
        config.attention)
    return TransformerConfig(
        vocab_size=vocab_size, d_model=config.d_model, num_layers=config.num_layers, num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads or None, head_dim=config.head_dim or None, mlp_ratio=config.mlp_ratio,
        mlp_multiple=config.mlp_multiple, rope_theta=config.rope_theta, remat=config.remat,
        max_seq_len=config.seq_len, context_parallel=cp,
        splash=splash_config(config), param_dtype=config.param_dtype, compute_dtype=compute_dtype(config),
    )


def stdlib_files() -> tuple[list[str], list[str]]:
    """(train, held-out) paths: the stdlib's top-level .py files, one in ten held out by name."""
    from ringsplash.data import is_held_out

    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    held = [is_held_out(os.path.basename(p).encode()) for p in paths]
    return [p for p, h in zip(paths, held) if not h], [p for p, h in zip(paths, held) if h]


def corpora(config: Config) -> tuple[str, str]:
    """(training corpus, held-out corpus) directories, the same one twice for ``--data`` alone (its
    documents split by ``data.is_held_out``); the default stdlib ones are tokenized here (a no-op
    when already done)."""
    from ringsplash import data

    if config.data:
        return config.data, config.heldout or config.data
    options = data.TokenizeOptions(errors="replace")
    out = []
    for name, files in zip(("stdlib-train", "stdlib-heldout"), stdlib_files(), strict=True):
        path = os.path.join(config.corpus_dir, name)
        data.tokenize_corpus(files, path, options, progress=config.progress)
        out.append(path)
    return out[0], config.heldout or out[1]


class Datasets(NamedTuple):
    loader: Any  # data.Loader: the training rows
    heldout: Any  # data.Loader: the held-out rows (documents cut at row ends)
    unit: str  # "byte" or "token"
    summary: str  # the line main prints: documents trained on, held out (how many, or which corpus)


def datasets(config: Config) -> Datasets:
    """The training and held-out loaders of ``config``. ``--data`` alone: one corpus, its documents
    split by ``data.is_held_out`` (``LoaderConfig.documents`` "train" / "heldout"), so no held-out
    document is ever in a training row; with ``--heldout``: every document of each corpus."""
    from ringsplash import data
    from ringsplash.data.loader import SEED_LIMIT  # the held-out seed wraps: --seed 2**31 - 1 was refused there

    train_path, heldout_path = corpora(config)
    split = heldout_path == train_path  # --data alone
    loader = _loader("--data" if config.data else None, split, train_path, data.LoaderConfig(
        seq_len=config.seq_len, batch_size=config.batch_size, seed=config.seed, packing=config.packing,
        documents="train" if split else "all"))
    # held out: documents cut at row ends (concat_split), so each piece starts its document's context
    heldout_flag = "--heldout" if config.heldout else "--data" if split else None
    heldout = _loader(heldout_flag, split, heldout_path, data.LoaderConfig(
        seq_len=config.seq_len, batch_size=config.batch_size, seed=(config.seed + 1) % SEED_LIMIT,
        packing="concat_split",
        documents="heldout" if split else "all"))
    if not split and heldout.corpora[0].fingerprint == loader.corpora[0].fingerprint:
        raise ValueError(f"--heldout {heldout_path!r} holds the same documents as --data {train_path!r}: pass a "
                         f"corpus of other documents")
    unit = "byte" if loader.corpora[0].manifest["tokenizer"]["kind"] == "bytes" else "token"
    trained = loader.sources[0].documents
    held_out = (f"held out: {len(heldout.sources[0].documents)} of its {len(loader.corpora[0])} documents (one in "
                f"{data.HELD_OUT_EVERY}, by a hash of each document's tokens), never trained on" if split else
                f"held out: {heldout_path} ({len(heldout.corpora[0])} other documents)")
    summary = (f"corpus {train_path}: {len(trained)} documents trained on, "
               f"{int(loader.corpora[0].lengths[trained].sum())} {unit}s, {loader.sources[0].plan.num_rows} packed "
               f"rows ({config.packing}); {held_out}")
    return Datasets(loader, heldout, unit, summary)


def _loader(flag: str | None, split: bool, path: str, config):
    """``data.Loader(path, config)``; an error naming ``flag`` (the corpus's; None: the default one)
    when ``path`` is no corpus, or when ``--data`` split has no document on one side."""
    from ringsplash import data

    try:
        return data.Loader(path, config)
    except FileNotFoundError as e:
        if flag is None:
            raise
        raise FileNotFoundError(f"{flag} {path!r} is not accepted: expected a tokenized corpus directory "
                                f"({e})") from None
    except ValueError as e:
        if not split:
            raise
        raise ValueError(f"{flag} {path!r}: {e}; pass --heldout, a corpus of other documents") from None


BUCKETS = (0, 8, 32, 128, 256, 512, 1024, 2048, 4096)


def main(config: Config, hooks=()) -> dict:
    # hooks: more train.fit hooks for every training run (the tests install one that kills the process mid-run)
    # the TPU when there is one, else the CPU with a simulated device per mesh position
    config = choose_devices(config, cpu_context=4, other=config.data_parallel,
                            shards_context=config.attention == "ring")
    import numpy as np
    import optax

    from ringsplash import train

    t0 = time.perf_counter()
    run_dir = config.run_dir or os.path.join("runs", "byte_lm", time.strftime("%Y%m%d-%H%M%S"))
    loader, heldout, unit, summary = datasets(config)
    train_path = loader.paths[0]
    model_cfg = model_config(config, loader.vocab_size)
    tc = train.TrainConfig(
        steps=config.steps, batch_size=config.batch_size, learning_rate=config.learning_rate,
        warmup_steps=min(config.warmup_steps, config.steps), data_parallel=config.data_parallel,
        seed=config.seed, progress=config.progress,
        checkpoint_every=config.checkpoint_every, log_every=config.log_every,
    )
    mesh = train.mesh_for(model_cfg, tc.data_parallel)
    resumed_at = continue_to(run_dir, tc)
    print(f"run directory: {run_dir}" + (f" (resuming from its checkpoint); step {resumed_at} of {config.steps}"
                                         if resumed_at is not None else
                                         f" (rerun with --run-dir {run_dir} to resume it)"))
    print(summary)
    print(distributed.device_line())
    print(f"{config.attention} over {model_cfg.context_parallel.shards} device(s), seq_len={config.seq_len}, backend="
          f"{config.backend}, blocks={config.block or 'auto'}, dtypes param={config.param_dtype} "
          f"compute={compute_dtype(config)}", flush=True)
    state = train.fit(model_cfg, tc, loader, run_dir, mesh=mesh, hooks=hooks)

    logits_fn = train.make_logits_fn(model_cfg, mesh, plan=train.sharding_plan(model_cfg, mesh, tc.fsdp))
    sums = np.zeros(len(BUCKETS)), np.zeros(len(BUCKETS))
    for i in range(config.eval_batches):
        raw = heldout.batch(i)
        laid = train.layout_batch(raw, model_cfg)
        logits = np.asarray(logits_fn(state.model, train.shard_batch(raw, mesh, model_cfg)))
        ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, laid.labels))
        bucket = np.searchsorted(BUCKETS, laid.positions, side="right") - 1
        for k in range(len(BUCKETS)):
            w = laid.loss_mask * (bucket == k)
            sums[0][k] += float((ce * w).sum())
            sums[1][k] += float(w.sum())
    rows = [(BUCKETS[k], BUCKETS[k + 1] if k + 1 < len(BUCKETS) else None, sums[0][k] / sums[1][k], int(sums[1][k]))
            for k in range(len(BUCKETS)) if sums[1][k] > 0]
    print(f"held-out loss by position in context ({unit}s of the same document before the prediction):")
    print(f"{'position':>14}  {'loss (nats)':>11}  {'bits/' + unit:>10}  {'tokens':>7}")
    for lo, hi, loss, count in rows:
        span = f"[{lo}, {hi})" if hi else f"[{lo}, ...)"
        print(f"{span:>14}  {loss:>11.3f}  {loss / np.log(2):>10.3f}  {count:>7}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([max(lo, 1) for lo, *_ in rows], [r[2] / np.log(2) for r in rows], "o-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"position in context ({unit}s, bucket start)")
    ax.set_ylabel(f"held-out bits / {unit}")
    ax.set_title(f"LM on {os.path.basename(os.path.normpath(train_path))}: does more context help?")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    plot = os.path.join(run_dir, "loss_by_position.png")
    fig.savefig(plot, dpi=100)
    train_plot = train.MetricsLog(run_dir).plot(title=f"LM ({os.path.basename(os.path.normpath(train_path))})")
    print(f"plots: {plot}, {train_plot}")
    print(f"wall time: {time.perf_counter() - t0:.0f} s")
    return {"rows": rows, "run_dir": run_dir, "plot": plot, "state_digest": train.state_digest(state)}


if __name__ == "__main__":
    run_script(main, parse_args)
