"""The main job: long-context multi-query associative recall, trained with ring attention.

    python experiments/train_long_context.py            # the default run (3.5 minutes on 2 quiet CPU cores)
    python experiments/train_long_context.py --checkpoint-every 50 --run-dir runs/long  # resumable
    python experiments/train_long_context.py --run-dir runs/long                        # ... resume it
    python experiments/train_long_context.py --run-dir runs/long --steps 1400           # ... continue it further
    python experiments/train_long_context.py --attention splash --compute-dtype bfloat16  # one TPU chip (auto)
    python experiments/train_long_context.py --attention splash --compute-dtype bfloat16 --seq-len 65536 \
        --rope-theta 500000 --curriculum 16:0.1,64:0.1,256:0.1,1024:0.1,4096:0.15,16384:0.15  # 64K, one v5e: 4 min
    python experiments/train_long_context.py --qk-clip-threshold 20   # QK-clip (max logits in the metrics)
    python experiments/train_long_context.py --help     # every option

On the CPU the ring runs over 4 simulated devices; on a TPU over every device (``--context-parallel 0``).
The task, the curriculum and resuming: README.md ("The main job") and docs/training.md; the TPU runs: docs/tpu.md.
"""

import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _runtime: the experiments' shared start-up
from _runtime import (
    COMPUTE_DTYPES,
    DTYPES,
    check_block,
    check_flags,
    check_optional_flags,
    choose_devices,
    compute_dtype,
    context_devices,
    continue_to,
    run_script,
    splash_config,
)
from ringsplash import distributed
from ringsplash.cli import parse_config

# Fields that may change between a run and its resumption (they do not change the trained model's past);
# ``steps`` may grow: the run continues to the new total (the curriculum stays laid out over the first total).
RESUMABLE_CHANGES = ("run_dir", "progress", "checkpoint_every", "log_every", "steps")
__all__ = ["RESUMABLE_CHANGES", "Config", "main", "make_model_config", "parse_args"]


@dataclasses.dataclass(frozen=True)
class Config:
    # task
    seq_len: int = 1024  # tokens per row at the end of the curriculum (the model's max_seq_len)
    num_pairs: int = 32  # key-value pairs placed in each row
    num_queries: int = 32  # queried keys after the separator (each answer is scored)
    num_keys: int = 64  # distinct key tokens
    num_values: int = 16  # distinct value tokens (chance accuracy = 1 / num_values)
    num_filler: int = 16  # distinct filler tokens between the pairs
    #: "episode_len:fraction_of_steps,..." (the rest of the steps at seq_len); "" = seq_len throughout
    curriculum: str = "16:0.2,32:0.1,64:0.1,128:0.1,256:0.1,512:0.1"
    # model (the "tiny" preset; --preset NAME takes another's shape, any field still overridable;
    # the vocabulary is always the task's)
    preset: str = "tiny"  # a ringsplash.model.presets name; "" = the model fields below
    d_model: int = 64  # model width
    num_layers: int = 2  # transformer layers
    num_heads: int = 1  # query heads
    num_kv_heads: int = 1  # key/value heads (GQA: divides num_heads)
    head_dim: int = 64  # 0 = auto: d_model // num_heads
    mlp_ratio: float = 2.0  # SwiGLU hidden width / d_model (rounded up to mlp_multiple)
    mlp_multiple: int = 8  # the SwiGLU hidden width is a multiple of this
    rope_theta: float = 10_000.0  # RoPE base frequency
    #: RoPE scaling with Hugging Face's numerics: "" = none | linear | dynamic | yarn | llama3
    #: (dynamic / yarn / llama3 also need --rope-original-max-len)
    rope_scaling: str = ""
    rope_factor: float = 0.0  # RoPE scaling factor (context extension ratio); 0 = unset (needed with --rope-scaling)
    rope_original_max_len: int = 0  # the length the model was trained at; 0 = unset (needed except for linear)
    remat: str = "none"  # rematerialisation of each layer: none | full | save_attention | save_dots
    #: reference | splash (one device) | ring | allgather | ulysses (over the context axis) |
    #: usp (ring over context_parallel devices, Ulysses over ulysses_parallel devices inside)
    attention: str = "ring"
    layout: str = "zigzag"  # token layout over the context axis: contiguous | zigzag | striped
    backend: str = "auto"  # Splash backend: auto (mosaic_tpu on a TPU, xla elsewhere) | mosaic_tpu | interpret | xla
    block: int = 0  # Splash block size (tokens, a multiple of 128), every block of the kernels; 0 = auto: tuned
    param_dtype: str = "float32"  # parameter (master weight) dtype: float32 | bfloat16 | float16
    #: compute dtype of activations and matmuls: float32 | bfloat16 | float16 | auto (bfloat16 on a TPU,
    #: float32 elsewhere: _runtime.compute_dtype)
    compute_dtype: str = "auto"
    # parallelism (on CPU: simulated devices = data_parallel * context_parallel * ulysses_parallel)
    data_parallel: int = 1  # devices on the mesh's data axis (batch rows)
    #: devices on the mesh's context axis (the sequence is sharded over them); 0 = auto: 4 simulated
    #: devices on the CPU, every device (over --data-parallel x --ulysses-parallel) on a TPU
    context_parallel: int = 0
    ulysses_parallel: int = 1  # devices on the mesh's ulysses axis (attention="usp" only)
    # optimisation
    steps: int = 700  # training steps
    batch_size: int = 8  # global rows per step
    learning_rate: float = 3e-3  # peak AdamW learning rate (warmup, then cosine decay)
    warmup_steps: int = 30  # linear warmup steps
    weight_decay: float = 0.01  # AdamW weight decay
    #: QK-clip: rescale W_q / W_k of heads whose max attention logit exceeds this; None = off
    #: (the per-layer max logits go to metrics.jsonl and the plot; without clipping: --log-max-logits)
    qk_clip_threshold: float | None = None
    log_max_logits: bool = False  # log per-layer max attention logits (always on with --qk-clip-threshold)
    # bookkeeping
    eval_batches: int = 4  # held-out batches per evaluation
    eval_every: int = 100  # steps between evaluations; 0 = only at the end
    seed: int = 0  # seed of the parameters and the data
    run_dir: str = ""  # "" = auto: runs/train_long_context/<time>; resumed when it holds a checkpoint
    checkpoint_every: int = 0  # steps between checkpoints; 0 = a checkpoint only at the end
    log_every: int = 10  # steps between training-metric lines
    progress: bool = True  # show a progress bar

    def __post_init__(self):
        """Option strings checked at once, each error naming its flag (the library configs check the rest)."""
        from ringsplash.layouts import LAYOUTS
        from ringsplash.model.config import REMAT_POLICIES, STRATEGIES
        from ringsplash.splash.config import BACKENDS

        check_flags(self, choices={"remat": REMAT_POLICIES, "attention": STRATEGIES, "layout": LAYOUTS,
                                   "backend": BACKENDS, "param_dtype": DTYPES, "compute_dtype": COMPUTE_DTYPES},
                    positive=("seq_len", "num_pairs", "num_queries", "num_keys", "num_values", "num_filler", "d_model",
                              "num_layers", "num_heads", "num_kv_heads", "mlp_multiple", "data_parallel",
                              "ulysses_parallel", "steps", "batch_size", "eval_batches", "log_every"),
                    non_negative=("head_dim", "warmup_steps", "eval_every", "checkpoint_every", "context_parallel",
                                  "rope_original_max_len", "seed"),
                    positive_numbers=("mlp_ratio", "rope_theta"),
                    non_negative_numbers=("learning_rate", "weight_decay"))
        check_optional_flags(self, unset=0, positive_numbers=("rope_factor",))
        check_optional_flags(self, unset=None, positive_numbers=("qk_clip_threshold",))
        check_block(self)
        curriculum(self)  # its format (each error names --curriculum)


def parse_args(argv=None) -> Config:
    from ringsplash.model.presets import PRESETS

    return parse_config(Config, argv, description=__doc__, presets=PRESETS)


def curriculum(config: Config, steps: int | None = None) -> list[tuple[int, int]]:
    """``[(first_step, episode_len), ...]`` from ``config.curriculum``, its fractions of ``steps``
    (default ``config.steps``; a continued run keeps the total it started with)."""
    steps = config.steps if steps is None else steps

    def refuse(why: str):
        return ValueError(f"--curriculum {config.curriculum!r} is not accepted: expected 'episode_len:fraction_of_steps"
                          f",...' (e.g. 16:0.2,32:0.1){why}")

    stages, step, total = [], 0, 0.0
    for item in filter(None, config.curriculum.split(",")):
        try:
            length, fraction = item.split(":")
            length, fraction = int(length), float(fraction)
        except ValueError:
            raise refuse("") from None
        # a recall episode holds one key-value pair, the separator and one query at least (RecallTask.episode)
        if not 5 <= length <= config.seq_len or config.seq_len % length:
            raise refuse(f": episode_len {length} must be at least 5 tokens and divide --seq-len {config.seq_len}")
        if not 0 <= fraction <= 1:  # NaN and inf too
            raise refuse(f": fraction {fraction} must be in [0, 1]")
        total += fraction
        if total > 1 + 1e-9:
            raise refuse(f": the fractions add up to {total:g}, more than all the steps (the rest of the steps "
                         f"train at --seq-len)")
        stages.append((step, length))
        step += round(fraction * steps)
    stages.append((min(step, steps), config.seq_len))
    return stages


def job_config(config: Config, curriculum_steps: int) -> dict:
    """What a resumed run must share with the run it resumes (``run_dir/job_config.json``)."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in RESUMABLE_CHANGES}
    return {**fields, "curriculum_steps": curriculum_steps}


def context_parallel(config: Config):
    """The model's ``ContextParallel`` for ``--attention`` (the trainer's default mesh axes):
    ``--context-parallel`` devices on the first axis, USP's all-to-all over ``--ulysses-parallel``."""
    from ringsplash.model import ContextParallel
    from ringsplash.model.parallelism import RULES

    devices = context_devices(config)
    roles = RULES[config.attention].roles
    if len(roles) == 2:  # USP: the ring across, Ulysses inside
        return ContextParallel(config.attention, ring_size=devices,
                               ulysses_size=config.ulysses_parallel, layout=config.layout)
    cp = ContextParallel(layout=config.layout)
    return cp.on_axis(None, devices, config.attention) if roles else cp.single_device(config.attention)


def make_model_config(config: Config, vocab_size: int):
    """The ``TransformerConfig`` of ``config`` (the vocabulary: the task's)."""
    from ringsplash.model import ModelFeatures, TransformerConfig, rope_scaling_from_flags

    return TransformerConfig(
        vocab_size=vocab_size, d_model=config.d_model, num_layers=config.num_layers,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim or None,
        mlp_ratio=config.mlp_ratio, mlp_multiple=config.mlp_multiple, rope_theta=config.rope_theta,
        remat=config.remat, max_seq_len=config.seq_len,
        context_parallel=context_parallel(config),
        splash=splash_config(config), param_dtype=config.param_dtype, compute_dtype=compute_dtype(config),
        qk_clip_threshold=config.qk_clip_threshold,
        features=ModelFeatures(rope_scaling=rope_scaling_from_flags(config.rope_scaling, config.rope_factor,
                                                                    config.rope_original_max_len)),
    )


def episode_len_at(stages, step: int) -> int:
    return [length for first, length in stages if first <= step][-1]


def main(config: Config, hooks=()) -> dict:
    # hooks: more train.fit hooks for every training run (the tests install one that kills the process mid-run)
    # the TPU when there is one, else the CPU with a simulated device per mesh position
    config = choose_devices(config, cpu_context=4, other=config.data_parallel * config.ulysses_parallel)
    from ringsplash import checkpoints, data, train

    t_start = time.perf_counter()
    # several processes (a pod slice, scripts/launch_local.py): same flags everywhere, one run directory
    distributed.check_same_config({k: v for k, v in dataclasses.asdict(config).items() if k != "progress"})
    run_dir = distributed.agree_on(
        config.run_dir or os.path.join("runs", "train_long_context", time.strftime("%Y%m%d-%H%M%S")))
    say = print if distributed.is_main_process() else (lambda *a, **k: None)
    task = data.RecallTask(
        seq_len=config.seq_len, num_pairs=config.num_pairs, num_queries=config.num_queries,
        num_keys=config.num_keys, num_values=config.num_values, num_filler=config.num_filler,
    )
    model_config = make_model_config(config, task.vocab_size)
    tc = train.TrainConfig(
        steps=config.steps, batch_size=config.batch_size, learning_rate=config.learning_rate,
        warmup_steps=min(config.warmup_steps, config.steps), weight_decay=config.weight_decay,
        data_parallel=config.data_parallel, seed=config.seed, log_every=config.log_every,
        checkpoint_every=config.checkpoint_every, progress=config.progress, log_max_logits=config.log_max_logits,
    )
    # a continued run (a larger --steps) keeps the curriculum laid out over the steps it started with
    job_path = os.path.join(run_dir, "job_config.json")
    trained = checkpoints.latest_step(os.path.join(run_dir, "checkpoints")) is not None
    curriculum_steps = config.steps
    if trained and os.path.exists(job_path):
        with open(job_path) as f:
            curriculum_steps = json.load(f).get("curriculum_steps", config.steps)
    stages = curriculum(config, curriculum_steps)
    # per_row: every row is its own draw, so each process draws only the rows its devices hold
    stream = data.DataStream(
        make=lambda rng, n, step: task.batch(rng, n, episode_len=episode_len_at(stages, step)),
        batch_size=config.batch_size, seed=config.seed, per_row=True,
    )
    heldout = data.DataStream(make=lambda rng, n, step: task.batch(rng, n), batch_size=config.batch_size,
                              seed=config.seed + 1_000_003, per_row=True)
    mesh = train.mesh_for(model_config, tc.data_parallel)
    # held-out evaluation on the parameters as training shards them (never a replicated copy)
    eval_step = train.make_eval_step(model_config, mesh, plan=train.sharding_plan(model_config, mesh, tc.fsdp))

    def on_log(state, record):
        step = record["step"]
        extra = {"episode_len": episode_len_at(stages, step - 1)}
        if (config.eval_every and step % config.eval_every == 0) or step == config.steps:
            ev = train.evaluate(state.model, heldout, config.eval_batches, mesh, model_config, eval_step)
            log.write({"split": "eval", "step": step, **ev})
            extra["heldout_accuracy"] = ev["accuracy"]
        return extra

    log = train.MetricsLog(run_dir)
    # nothing trained yet: the curriculum follows --steps, whatever the first start said
    train.check_run_config(job_path, job_config(config, curriculum_steps),
                           ignore=() if trained else ("curriculum_steps",))
    resumed_at = continue_to(run_dir, tc, say)
    say(f"run directory: {run_dir}" + (f" (resuming from its checkpoint); step {resumed_at} of {config.steps}"
                                       if resumed_at is not None else ""))
    say(f"{distributed.device_line()}; mesh {dict(mesh.shape)}; attention={config.attention} layout={config.layout} "
        f"backend={config.backend} blocks={config.block or 'auto'}; dtypes param={config.param_dtype} "
        f"compute={compute_dtype(config)}; seq_len={config.seq_len}; curriculum {stages}", flush=True)
    state = train.fit(model_config, tc, stream, run_dir, mesh=mesh, on_log=on_log, hooks=hooks)
    final = train.evaluate(state.model, heldout, config.eval_batches, mesh, model_config, eval_step)
    plot = log.plot(title=f"associative recall, seq {config.seq_len}, {config.attention}")
    wall = time.perf_counter() - t_start
    result = {"heldout_accuracy": final["accuracy"], "heldout_loss": final["loss"], "chance": 1 / config.num_values,
              "run_dir": run_dir, "plot": plot, "wall_s": wall, "state_digest": train.state_digest(state)}
    say(f"held-out recall accuracy: {final['accuracy']:.3f} (chance {1 / config.num_values:.3f}) "
          f"on {config.eval_batches * config.batch_size} sequences of {config.seq_len} tokens, "
          f"{config.num_queries} queries each")
    say(f"final state digest: {result['state_digest']}")
    say(f"run directory: {run_dir}")
    say(f"plot: {plot}")
    say(f"wall time: {wall:.0f} s")
    return result


if __name__ == "__main__":
    run_script(main, parse_args)
