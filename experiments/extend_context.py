"""Context extension: train short, extend with each RoPE scaling, finetune long over the ring, measure.

1. Base: a model trained here at ``--base-len`` tokens on a tokenized corpus (``--data``; default:
   the Python standard library as bytes, as ``byte_lm.py``), or ``--init-from`` a Hugging Face
   checkpoint or a ringsplash run directory (its length is the base length). A small model learns
   retrieval slowly from text alone, so ``--passkey-mix`` of the training rows hold a synthetic
   retrieval task (``--retrieval``): ``recall``, the main job's key-value recall (its own tokens
   above the text's, only the answers scored, a curriculum of episode lengths), evaluated as a
   passkey in those tokens (``evals.token_passkey_task``); or ``text``, passkey documents in the
   evaluation's own text template with fresh keys, depths and offsets (``evals.passkey_task``);
   or ``none`` (text only).
2. For each ``--methods`` entry, the base parameters at ``--factor`` x the base length with
   - ``none``: RoPE unchanged;  ``base``: the RoPE base raised NTK-style, theta * factor^(d/(d-2));
   - ``linear`` (position interpolation), ``dynamic`` (dynamic NTK), ``yarn``, ``llama3``: the
     ``RopeScaling`` of that type (Hugging Face's numerics, ``ringsplash.model.rope_scaling``),
   evaluated zero-shot, then finetuned for ``--finetune-steps`` at the long length with the ring
   over ``--context-parallel`` devices (simulated CPU devices here) on packed long documents, and
   evaluated again.
3. Evaluation at lengths base, 2 x base, ..., factor x base, on one device: held-out perplexity
   (``--eval-docs`` windows of the held-out corpus per length) and passkey accuracy over a depth x
   length grid (teacher-forced: every digit of the key is the model's argmax; ``--generate``:
   also greedy generation through ``rs.inference.generate``), with a heatmap per method and phase.

Outputs under the run directory: ``results.jsonl`` (method x phase x length -> perplexity, passkey
accuracy), ``results.md`` (the table), ``perplexity.png`` (perplexity vs length per method),
``<method>/<phase>/heatmap_*.png`` + the grid's records, and each finetune's run directory.

    python experiments/extend_context.py                                   # the default, on CPU
    python experiments/extend_context.py --methods none,yarn --finetune-steps 20
    python experiments/extend_context.py --checkpoint-every 100 --run-dir runs/ext   # rerun it to resume it
    python experiments/extend_context.py --preflight v5p:4x4x4 --preset 1b --base-len 8192 --factor 16

``--preflight TOPOLOGY`` compiles each method's long finetune step for that TPU slice
(``scripts/aot_preflight.py``: per-device memory, Mosaic kernels) and exits; on the slice itself
the same command without it runs the experiment (``--backend auto`` picks the TPU kernels there,
``--context-parallel`` the slice's devices).

Resuming: with ``--run-dir`` the base training and each finetune checkpoint (``--checkpoint-every``,
and at their ends); rerunning the same command resumes where it stopped (a killed run ends as an
uninterrupted one would) and re-evaluates. A larger ``--finetune-steps`` continues each finetune
from its checkpoint; a larger ``--base-steps`` continues the base, and the finetunes then start
again from the longer-trained base (the old ones are kept, renamed ``<method>.base<step>``).
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
import time

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
    flag_error,
    run_script,
    splash_config,
)
from ringsplash import distributed
from ringsplash.cli import parse_config

METHODS = ("none", "base", "linear", "dynamic", "yarn", "llama3")
RETRIEVAL = ("recall", "text", "none")
# Fields that may change between a run and its resumption: bookkeeping, the step counts (a run
# continues to a larger total), which methods run and how they are scored (evaluations run again).
RESUMABLE_CHANGES = ("run_dir", "progress", "checkpoint_every", "base_steps", "finetune_steps", "methods",
                     "generate", "preflight")


@dataclasses.dataclass(frozen=True)
class Config:
    data: str = ""  # a tokenized corpus directory (scripts/tokenize_corpus.py); "" = the Python stdlib, bytes
    heldout: str = ""  # the held-out corpus; "" = the stdlib's held-out tenth (with --data: --data itself)
    corpus_dir: str = "runs/corpora"  # where the default stdlib corpora and the passkey documents are written
    tokenizer: str = "bytes"  # the corpus's tokenizer for the passkey text: bytes or a tokenizer.json path
    init_from: str = ""  # a Hugging Face checkpoint or a ringsplash run directory; "" = train the base model here
    base_len: int = 1024  # the base model's training length (with --init-from: 0 = the model's max_seq_len)
    factor: int = 8  # the extension: evaluate and finetune at factor x base_len
    methods: str = ",".join(METHODS)  # comma-separated subset of none,base,linear,dynamic,yarn,llama3
    #: the retrieval task trained (passkey_mix of the rows) and evaluated as the passkey: recall (the main job's
    #: key-value recall, tokens of its own) | text (passkey documents in text) | none (text only, text passkey)
    retrieval: str = "recall"
    passkey_mix: float = 0.5  # share of training rows holding the retrieval task (0 = text only)
    passkey_docs: int = 512  # --retrieval text: passkey documents written per length (base and long)
    # model (trained here): --preset NAME (ringsplash.model.presets) sets the shape, flags override it
    preset: str = ""  # a ringsplash.model.presets name; "" = the model fields below
    d_model: int = 64  # model width
    num_layers: int = 2  # transformer layers
    num_heads: int = 4  # query heads
    num_kv_heads: int = 0  # key/value heads (GQA); 0 = auto: num_heads
    rope_theta: float = 10_000.0  # RoPE base of the base model
    base_steps: int = 2000  # base training steps
    base_batch: int = 8  # rows per base step
    base_lr: float = 3e-3  # base peak learning rate
    finetune_steps: int = 150  # long finetune steps per method
    finetune_batch: int = 2  # rows per finetune step (each factor x base_len tokens)
    finetune_lr: float = 1e-3  # finetune peak learning rate
    #: devices of the finetune's ring; 0 = auto: 8 simulated devices on the CPU, every device on a TPU
    context_parallel: int = 0
    layout: str = "zigzag"  # token layout over the ring: contiguous | zigzag | striped
    backend: str = "auto"  # Splash backend: auto (mosaic_tpu on a TPU, xla elsewhere) | mosaic_tpu | interpret | xla
    block: int = 0  # Splash block size (tokens, a multiple of 128); 0 = auto: the blocks tuned for the platform
    param_dtype: str = "float32"  # parameter (master weight) dtype: float32 | bfloat16 | float16
    #: compute dtype of activations and matmuls: float32 | bfloat16 | float16 | auto (bfloat16 on a TPU,
    #: float32 elsewhere: _runtime.compute_dtype)
    compute_dtype: str = "auto"
    eval_docs: int = 2  # held-out windows per evaluation length (perplexity)
    passkey_samples: int = 8  # passkey prompts per (length, depth) cell
    depths: str = "0,0.5,1"  # passkey depths (fraction of the haystack before the key)
    generate: bool = False  # also score the passkey by greedy generation (rs.inference.generate)
    preflight: str = ""  # a TPU topology: compile each method's finetune step for it (AOT) and exit; "" = run
    seed: int = 0  # parameters, data order, passkey keys
    run_dir: str = ""  # "" = auto: runs/extend_context/<time>; resumed when it holds checkpoints
    checkpoint_every: int = 0  # steps between checkpoints of the base and of each finetune; 0 = only at their ends
    progress: bool = True  # progress bars

    def __post_init__(self):
        from ringsplash.layouts import LAYOUTS
        from ringsplash.splash.config import BACKENDS

        bad = [m for m in self.method_list if m not in METHODS]
        if bad or not self.method_list:
            raise ValueError(f"--methods methods={self.methods!r} is not accepted: expected a comma-separated "
                             f"subset of {METHODS}")
        if isinstance(self.factor, bool) or not isinstance(self.factor, int) or self.factor < 2:
            raise ValueError(f"--factor factor={self.factor!r} is not accepted: expected an int >= 2")
        if self.retrieval not in RETRIEVAL:
            raise ValueError(f"--retrieval retrieval={self.retrieval!r} is not accepted: expected one of {RETRIEVAL}")
        if not 0.0 <= self.passkey_mix < 1.0:
            raise ValueError(f"--passkey-mix passkey_mix={self.passkey_mix} is not accepted: expected a number "
                             f"in [0, 1)")
        if self.init_from and not os.path.isdir(self.init_from):  # read only after the corpora are built: now
            raise flag_error("init_from", self.init_from, "a Hugging Face checkpoint or a ringsplash run directory")
        if not self.init_from and self.base_len < 128:
            raise ValueError(f"--base-len base_len={self.base_len} is not accepted: expected >= 128")
        if self.context_parallel < 0:
            raise ValueError(f"--context-parallel context_parallel={self.context_parallel} is not accepted: expected "
                             f">= 0 (0 = auto)")
        for name in ("base_steps", "finetune_steps", "base_batch", "finetune_batch", "eval_docs",
                     "passkey_samples", "passkey_docs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {name}={getattr(self, name)} is not accepted: "
                                 f"expected >= 1")
        check_flags(self, choices={"layout": LAYOUTS, "backend": BACKENDS, "param_dtype": DTYPES,
                                   "compute_dtype": COMPUTE_DTYPES},
                    positive=("d_model", "num_layers", "num_heads"),
                    non_negative=("num_kv_heads", "checkpoint_every", "seed"),
                    positive_numbers=("rope_theta",), non_negative_numbers=("base_lr", "finetune_lr"))
        check_block(self)
        check_loader_seed(self)
        try:  # read after the base model has trained: checked now
            depths = [float(d) for d in self.depths.split(",")]
        except ValueError:
            depths = []
        if not depths or not all(0 <= d <= 1 for d in depths):
            raise flag_error("depths", self.depths, "comma-separated fractions in [0, 1] (e.g. 0,0.5,1)")

    @property
    def method_list(self) -> list[str]:
        return [m.strip() for m in self.methods.split(",") if m.strip()]


def parse_args(argv=None) -> Config:
    from ringsplash.model.presets import PRESETS

    return parse_config(Config, argv, description=__doc__, presets=PRESETS)


# ------------------------------------------------------------------------------------ configs


def base_model_config(config: Config, vocab_size: int):
    """The base model: one device (Splash), ``base_len`` tokens."""
    from ringsplash.model import ContextParallel, TransformerConfig

    return TransformerConfig(
        vocab_size=vocab_size, d_model=config.d_model, num_layers=config.num_layers, num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads or None, rope_theta=config.rope_theta, max_seq_len=config.base_len,
        context_parallel=ContextParallel("splash"), splash=splash_config(config), param_dtype=config.param_dtype,
        compute_dtype=compute_dtype(config))


def extended(base, method: str, factor: int, base_len: int):
    """``base`` at ``factor * base_len`` tokens with ``method``'s RoPE (a one-device config)."""
    from ringsplash.model import RopeScaling

    theta, scaling = base.rope_theta, None
    if method == "base":  # NTK-aware base change: the lowest frequency's wavelength grows by ~factor
        theta = base.rope_theta * factor ** (base.head_dim / (base.head_dim - 2))
    elif method == "linear":
        scaling = RopeScaling(type="linear", factor=float(factor))
    elif method in ("dynamic", "yarn"):
        scaling = RopeScaling(type=method, factor=float(factor), original_max_position_embeddings=base_len)
    elif method == "llama3":  # Llama 3.1's defaults for the smooth band
        scaling = RopeScaling(type="llama3", factor=float(factor), original_max_position_embeddings=base_len,
                              low_freq_factor=1.0, high_freq_factor=4.0)
    return base.replace(max_seq_len=factor * base_len, rope_theta=theta,
                        features=base.features.replace(rope_scaling=scaling))


def on_ring(c, config: Config):
    """``c`` with its attention as the finetune's ring over ``config.context_parallel`` devices."""
    cp = c.context_parallel.on_axis(None, context_devices(config), "ring", layout=config.layout)
    return c.replace(context_parallel=cp, splash=splash_config(config))


# ------------------------------------------------------------------------------------ data


def passkey_corpus(config: Config, tokenizer, haystack, length: int, name: str) -> str:
    """``config.passkey_docs`` passkey documents of up to ``length`` tokens (prompt + key, the
    evaluation's template with fresh keys, depths and offsets), tokenized as a corpus (a no-op
    when already written with these settings)."""
    import numpy as np

    from ringsplash import data, evals

    task = evals.passkey_task(tokenizer)
    rng = np.random.default_rng([config.seed, length, 17])
    src = os.path.join(config.corpus_dir, f"{name}.jsonl")
    os.makedirs(config.corpus_dir, exist_ok=True)
    with open(src, "w") as f:
        for _ in range(config.passkey_docs):
            # a prompt of a random length (at least the template's), 5% below the row for re-tokenization
            hi = int(0.95 * length) - task.key_len
            if hi < task.overhead:
                raise ValueError(f"passkey documents of {length} tokens cannot hold the passkey template "
                                 f"({task.overhead} tokens + the key): raise --base-len or pass --passkey-mix 0")
            n = int(rng.integers(min(task.overhead + 16, hi), hi + 1))
            key = task.draw_key(rng)
            prompt = task.prompt(haystack, n, float(rng.random()), key, int(rng.integers(0, haystack.tokens.size)))
            text = tokenizer.decode([int(t) for t in prompt]) + task.key_text(key) + "."
            f.write(json.dumps({"text": text}) + "\n")
    out = os.path.join(config.corpus_dir, name)
    data.tokenize_corpus(src, out, data.TokenizeOptions(tokenizer=config.tokenizer), overwrite=True, progress=False)
    return out


def recall_task(length: int):
    """The key-value recall task at ``length`` tokens (chance 1/16), as the main job trains it."""
    from ringsplash import data

    return data.RecallTask(seq_len=length, num_pairs=16, num_queries=16, num_keys=64, num_values=16, num_filler=16)


def episode_schedule(length: int, steps: int):
    """``step -> episode length`` of the recall rows: the main job's curriculum (16 tokens for the first
    20% of the steps, then each doubling for 10% while it divides ``length``), then whole rows."""
    short = [n for n in (16 << i for i in range(32)) if n < length and length % n == 0]
    ends = [int(steps * (0.2 + 0.1 * i)) for i in range(len(short))]
    return lambda step: next((n for n, end in zip(short, ends, strict=True) if step < end), length)


def mixed_stream(loader, length: int, recall_rows: int, steps: int, offset: int, seed: int):
    """Batches of the loader's text rows followed by ``recall_rows`` rows of key-value recall whose
    tokens sit above the text's (``offset``), short episodes first over ``steps`` (0: whole rows
    throughout); a pure function of ``(seed, step)``, as ``fit`` needs."""
    import numpy as np

    from ringsplash import data

    task, episode = recall_task(length), episode_schedule(length, steps)

    def make(rng, n, step):
        text = loader.batch(step)
        rec = task.batch(rng, recall_rows, episode_len=episode(step))
        rec = rec._replace(tokens=rec.tokens + offset, labels=rec.labels + offset)
        return data.Batch(*(np.concatenate([np.asarray(a), np.asarray(b, np.asarray(a).dtype)])
                            for a, b in zip(text, rec, strict=True)))

    return data.DataStream(make=make, batch_size=loader.batch_size + recall_rows, seed=seed)


def passkey_eval(config: Config, tokenizer, text_vocab: int):
    """(task, haystack, answer tokens generated past the key) of the passkey evaluation."""
    import numpy as np

    from ringsplash import evals

    if config.retrieval == "recall":  # one key-value pair in filler, then ``SEP key``: the value
        t, off = recall_task(config.base_len), text_vocab
        task = evals.token_passkey_task(off + t.key_offset, off, range(off + t.value_offset,
                                                                       off + t.value_offset + t.num_values))
        filler = np.random.default_rng([config.seed, 5]).integers(off + 1, off + 1 + t.num_filler, size=1 << 16)
        return task, evals.Haystack(filler), 0
    return evals.passkey_task(tokenizer), evals.Haystack.from_text(evals.default_text(), tokenizer), 4


def text_corpora(config: Config) -> tuple[str, str]:
    """(training corpus, held-out corpus): ``--data`` / ``--heldout``, or the stdlib as bytes."""
    if config.data:
        return config.data, config.heldout or config.data
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import byte_lm

    return byte_lm.corpora(byte_lm.Config(corpus_dir=config.corpus_dir, progress=config.progress))


def heldout_stream(path: str, tokens: int):
    """The first ``tokens`` tokens of the held-out corpus's documents, concatenated."""
    import numpy as np

    from ringsplash import data

    corpus, parts, n = data.TokenizedCorpus(path), [], 0
    for i in range(len(corpus)):
        parts.append(np.asarray(corpus[i]))
        n += parts[-1].size
        if n >= tokens:
            break
    if n < tokens:
        raise ValueError(f"the held-out corpus {path} has {n} tokens, fewer than the {tokens} the evaluation needs "
                         f"(eval_docs x the longest length): pass a larger --heldout or fewer --eval-docs")
    return np.concatenate(parts)[:tokens]


# ------------------------------------------------------------------------------------ evaluation


def evaluate(model, config: Config, lengths, heldout, passkey, out_dir: str, title: str) -> list[dict]:
    """Perplexity and passkey accuracy of ``model`` (one device) at each length; the grid's files."""
    import jax
    import numpy as np

    from ringsplash import evals

    # one device, params committed there: the zero-shot and the finetuned model (fit leaves it on the
    # ring's mesh) then share the scorer's compiled programs
    model = jax.device_put(evals.single_device(model, "splash"), jax.devices()[0])
    scorer = evals.Scorer(model)
    depths = [float(d) for d in config.depths.split(",")]
    generate_fn = evals.inference_generate_fn(model) if config.generate else None
    task, haystack, extra = passkey
    records = evals.run_grid(scorer, task, haystack, lengths, depths, config.passkey_samples, extra_tokens=extra,
                             generate_fn=generate_fn, seed=config.seed, progress=config.progress)
    grid = evals.write_grid(records, out_dir, title)
    rows = []
    for length in lengths:
        windows = evals.document_rows(heldout, length, config.eval_docs)
        nll = evals.loss_by_position(scorer, windows, batch_size=1).per_position  # mean over the windows
        cells = [r for r in records if r["length"] == length]
        row = {"length": int(length), "perplexity": float(np.exp(nll.mean())),
               "passkey": float(np.mean([r["exact"] for r in cells]))}
        if config.generate:
            row["passkey_generated"] = float(np.mean([r["generated_match"] for r in cells]))
        rows.append(row)
    return rows + [{"files": grid["files"]}]


# ------------------------------------------------------------------------------------ the run


def preflight(config: Config, base, methods) -> int:
    """Compile each method's long finetune step for ``config.preflight`` (scripts/aot_preflight.py)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "aot_preflight.py")
    worst = 0
    for method in methods:
        c = extended(base, method, config.factor, config.base_len)
        args = ["--topology", config.preflight, "--seq-len", str(c.max_seq_len),
                *(["--block", str(config.block)] if config.block else []),  # 0 (auto): the preflight's default
                "--param-dtype", config.param_dtype, "--compute-dtype", compute_dtype(config),
                "--layout", config.layout, "--vocab-size", str(c.vocab_size), "--d-model", str(c.d_model),
                "--num-layers", str(c.num_layers), "--num-heads", str(c.num_heads), "--num-kv-heads",
                str(c.num_kv_heads), "--head-dim", str(c.head_dim), "--rope-theta", repr(c.rope_theta),
                "--batch-size", str(config.finetune_batch)]
        s = c.features.rope_scaling
        if s is not None:
            args += ["--rope-scaling", s.type, "--rope-factor", repr(s.factor)]
            if s.original_max_position_embeddings:
                args += ["--rope-original-max-len", str(s.original_max_position_embeddings)]
        print(f"[{method}] python scripts/aot_preflight.py {' '.join(args)}", flush=True)
        r = subprocess.run([sys.executable, script, *args], check=False)
        worst = max(worst, r.returncode)
    return worst


def job_config(config: Config, base_curriculum_steps: int) -> dict:
    """What a resumed run must share with the run it resumes (``run_dir/job_config.json``)."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in RESUMABLE_CHANGES}
    return {**fields, "base_curriculum_steps": base_curriculum_steps}


def _finetune_dir(run_dir: str, method: str, base_step: int | None) -> str:
    """``run_dir/<method>/finetune``, its base recorded; a finetune started from another base (an
    earlier step of a continued base) is set aside as ``<method>.base<step>``, to start again."""
    method_dir = os.path.join(run_dir, method)
    record = os.path.join(method_dir, "base.json")
    if base_step is not None and os.path.exists(record):
        with open(record) as f:
            was = json.load(f)["base_step"]
        if was != base_step:
            aside = f"{method_dir}.base{was}"
            os.replace(method_dir, aside)
            print(f"[{method}] the base now has {base_step} steps: its finetune from the base at step {was} "
                  f"moved to {aside}; finetuning again", flush=True)
    os.makedirs(method_dir, exist_ok=True)
    if base_step is not None and not os.path.exists(record):
        with open(record, "w") as f:
            json.dump({"base_step": base_step}, f)
    return os.path.join(method_dir, "finetune")


def main(config: Config, hooks=()) -> dict:
    # hooks: more train.fit hooks for every training run (the tests install one that kills the process mid-run)
    # the TPU when there is one, else the CPU with a simulated device per member of the ring
    config = choose_devices(config, cpu_context=8)
    import numpy as np

    from ringsplash import checkpoints, data, evals, train

    t0 = time.perf_counter()
    run_dir = config.run_dir or os.path.join("runs", "extend_context", time.strftime("%Y%m%d-%H%M%S"))
    methods = config.method_list
    tokenizer = evals.load_tokenizer(config.tokenizer)

    base_model = None
    if config.init_from:
        base_model = evals.load_model(config.init_from)
        config = dataclasses.replace(config, base_len=config.base_len or base_model.config.max_seq_len)
    if config.preflight:
        extra = recall_task(config.base_len).vocab_size if config.retrieval == "recall" else 0
        base = base_model.config if base_model is not None else base_model_config(config, tokenizer.vocab_size + extra)
        return {"returncode": preflight(config, base, methods)}

    os.makedirs(run_dir, exist_ok=True)
    # a continued run (a larger --base-steps) keeps the base's recall curriculum laid out over its first total
    job_path = os.path.join(run_dir, "job_config.json")
    base_ckpt = os.path.join(run_dir, "base_model", "checkpoints")
    trained = checkpoints.latest_step(base_ckpt) is not None
    curriculum_steps = config.base_steps
    if trained and os.path.exists(job_path):
        with open(job_path) as f:
            curriculum_steps = json.load(f).get("base_curriculum_steps", config.base_steps)
    train.check_run_config(job_path, job_config(config, curriculum_steps),
                           ignore=() if trained else ("base_curriculum_steps",))
    print(f"run directory: {run_dir}" + (" (resuming: finished parts are restored from their checkpoints)"
                                         if trained else f" (rerun with --run-dir {run_dir} to resume it)"))
    print(f"{distributed.device_line()}; backend={config.backend} blocks={config.block or 'auto'}; dtypes "
          f"param={config.param_dtype} compute={compute_dtype(config)}", flush=True)
    long_len = config.factor * config.base_len
    lengths = [config.base_len * 2**i for i in range(int(math.log2(config.factor)) + 1)]
    if lengths[-1] != long_len:
        lengths.append(long_len)
    train_path, heldout_path = text_corpora(config)
    heldout = heldout_stream(heldout_path, config.eval_docs * long_len)
    text_vocab = data.TokenizedCorpus(train_path).vocab_size
    recall = config.retrieval == "recall"
    vocab = text_vocab + (recall_task(config.base_len).vocab_size if recall else 0)
    if base_model is not None and recall and base_model.config.vocab_size != vocab:
        raise ValueError(f"--init-from {config.init_from}: a vocabulary of {base_model.config.vocab_size} tokens, but "
                         f"--retrieval recall needs the corpus's {text_vocab} + the recall task's "
                         f"{vocab - text_vocab} = {vocab} (a base trained by this script with the same corpus); "
                         f"pass --retrieval text (passkey documents in text) or none for other models")
    passkey = passkey_eval(config, tokenizer, text_vocab)

    def stream(length: int, batch: int, curriculum_steps: int, name: str):
        """The training batches at ``length``: text (+ passkey documents) through the loader, or text
        rows + recall rows (a curriculum of episode lengths over ``curriculum_steps``)."""
        mixed = config.passkey_mix > 0 and config.retrieval != "none"
        if recall and mixed:
            if batch < 2:
                raise ValueError(f"--retrieval recall mixes text rows and recall rows: a batch of {batch} row(s) "
                                 f"at {length} tokens has no room for both (pass 2 or more)")
            rows = min(batch - 1, max(1, round(config.passkey_mix * batch)))
            loader = data.Loader(train_path, data.LoaderConfig(seq_len=length, batch_size=batch - rows,
                                                               seed=config.seed))
            return mixed_stream(loader, length, rows, curriculum_steps, text_vocab, config.seed)
        paths, weights = [train_path], None
        if mixed:
            hay = passkey[1]  # --retrieval text: the evaluation's own haystack
            paths.append(passkey_corpus(config, tokenizer, hay, length, f"passkey-{name}-{length}"))
            weights = (1.0 - config.passkey_mix, config.passkey_mix)
        return data.Loader(paths, data.LoaderConfig(seq_len=length, batch_size=batch, seed=config.seed,
                                                    weights=weights))

    base_step = None  # the trained base's steps (None: --init-from)
    if base_model is None:  # 1. the base model
        base_cfg = base_model_config(config, vocab)
        tc = train.TrainConfig(steps=config.base_steps, batch_size=config.base_batch, learning_rate=config.base_lr,
                               warmup_steps=max(1, config.base_steps // 10), seed=config.seed,
                               log_every=max(1, config.base_steps // 20), checkpoint_every=config.checkpoint_every,
                               progress=config.progress)
        base_dir = os.path.join(run_dir, "base_model")
        continue_to(base_dir, tc)
        print(f"base: {config.base_steps} steps x {config.base_batch} rows x {config.base_len} tokens", flush=True)
        state = train.fit(base_cfg, tc, stream(config.base_len, config.base_batch, curriculum_steps, "base"),
                          base_dir, mesh=train.make_mesh(1, 1), hooks=hooks)
        base_model, base_step = state.model, int(state.step)
    base = base_model.config

    results = []
    long_stream = stream(long_len, config.finetune_batch, 0, "long")  # whole-length recall rows
    mesh = train.mesh_for(on_ring(base, config))
    for method in methods:  # 2. each method: zero-shot, finetune on the ring, again
        ext = extended(base, method, config.factor, config.base_len)
        zero = base_model.with_config(ext)
        for phase, model in (("zero_shot", zero), ("finetuned", None)):
            if model is None:
                steps = config.finetune_steps
                tc = train.TrainConfig(steps=steps, batch_size=config.finetune_batch, learning_rate=config.finetune_lr,
                                       warmup_steps=max(1, steps // 10), seed=config.seed,
                                       log_every=max(1, steps // 10), checkpoint_every=config.checkpoint_every,
                                       progress=config.progress)
                finetune_dir = _finetune_dir(run_dir, method, base_step)
                continue_to(finetune_dir, tc)
                print(f"[{method}] finetune: {config.finetune_steps} steps x {config.finetune_batch} rows x "
                      f"{long_len} tokens, ring over {config.context_parallel} devices", flush=True)
                model = train.fit(on_ring(ext, config), tc, long_stream, finetune_dir,
                                  mesh=mesh, init_model=zero, hooks=hooks).model.with_config(ext)
            out = evaluate(model, config, lengths, heldout, passkey, os.path.join(run_dir, method, phase),
                           f"{method} {phase}")
            for row in out[:-1]:
                results.append({"method": method, "phase": phase, **row})
                print(f"[{method} {phase}] length {row['length']:>6}: perplexity {row['perplexity']:.3f}, "
                      f"passkey {row['passkey']:.2f}", flush=True)

    # 3. the table, the records and the figure
    with open(os.path.join(run_dir, "results.jsonl"), "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    table = results_table(results, lengths)
    with open(os.path.join(run_dir, "results.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    plot = os.path.join(run_dir, "perplexity.png")
    plot_perplexity(results, lengths, plot, title=f"extending {config.base_len} -> {long_len} tokens")
    wall = time.perf_counter() - t0
    print(f"results: {run_dir}/results.md, {plot}; wall time {wall:.0f} s")
    finite = bool(np.all([np.isfinite(r["perplexity"]) for r in results]))
    return {"results": results, "run_dir": run_dir, "table": table, "plot": plot, "wall_s": wall, "returncode": 0,
            "lengths": lengths, "all_finite": finite, "base_step": base_step}


def plot_perplexity(results: list[dict], lengths, path: str, title: str = "") -> None:
    """Held-out perplexity vs evaluation length: a colour per method, dashed zero-shot, solid finetuned."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    methods = [m for m in METHODS if any(r["method"] == m for r in results)]
    for k, method in enumerate(methods):
        for phase, style in (("zero_shot", "--"), ("finetuned", "-")):
            ys = [r["perplexity"] for r in results if (r["method"], r["phase"]) == (method, phase)]
            if ys:
                ax.plot(lengths, ys, style, marker="o", ms=3, color=f"C{k}",
                        label=f"{method} ({'zero-shot' if phase == 'zero_shot' else 'finetuned'})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("held-out perplexity")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def results_table(results: list[dict], lengths) -> str:
    """Markdown: one row per method and phase, a ``perplexity / passkey`` cell per length."""
    head = "| method | phase | " + " | ".join(f"{n} ppl / passkey" for n in lengths) + " |"
    lines = [head, "|" + "---|" * (2 + len(lengths))]
    order = lambda k: (METHODS.index(k[0]), k[1] != "zero_shot")
    keys = sorted({(r["method"], r["phase"]) for r in results}, key=order)
    for method, phase in keys:
        cells = {r["length"]: r for r in results if (r["method"], r["phase"]) == (method, phase)}
        lines.append(f"| {method} | {phase} | " + " | ".join(
            f"{cells[n]['perplexity']:.2f} / {cells[n]['passkey']:.2f}" for n in lengths) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(run_script(main, parse_args)["returncode"])
