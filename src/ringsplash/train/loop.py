"""``fit``: the training loop. It restores the latest checkpoint (or starts fresh), checks the
run's config, steps with the next batch drawn on the host while the device works, logs metrics
and checkpoints; a resumed run is bit-identical to an uninterrupted one."""

import dataclasses
import os
import time
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ringsplash import _caches as caches
from ringsplash import checkpoints
from ringsplash.data import DataStream, Loader
from ringsplash.distributed import is_main_process
from ringsplash.model import Transformer, TransformerConfig
from ringsplash.train.batches import place_rows, process_rows, stream_batch
from ringsplash.train.config import (
    BOOKKEEPING_FIELDS,
    TrainConfig,
    learning_rate_schedule,
    make_optimizer,
    program_config,
)
from ringsplash.train.mesh import make_mesh
from ringsplash.train.metrics import MetricsLog, max_logit_metrics
from ringsplash.train.state import (
    TrainState,
    check_run_config,
    init_sharded_state,
    resume_state,
    save_checkpoint,
    start_from,
)
from ringsplash.train.step import make_train_step, sharding_plan


def _sync_processes(name: str) -> None:
    """A barrier across processes (a no-op in a single-process run)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _stop_if_nonfinite(pending: list, ckpt: str) -> None:
    """Raise at the first of the ``(step, loss, grad_norm)`` device scalars (the steps since the
    last check, fetched only now: no synchronisation per step) whose loss or norm is NaN/Inf."""
    for step, loss, grad_norm in jax.device_get(pending):
        if np.isfinite(loss) and np.isfinite(grad_norm):
            continue
        latest = checkpoints.latest_step(ckpt)
        raise FloatingPointError(
            f"training stopped: the loss or gradient norm is NaN/Inf at step {step}; "
            + (f"the newest checkpoint ({ckpt}, step {latest}) predates it" if latest is not None
               else "no checkpoint was written")
            + " (lower the learning rate, check the data and the restored weights)"
        )


def _check_loader(loader: Loader, model_config: TransformerConfig, tc: TrainConfig) -> None:
    """A loader that fits the model and the run (before any work)."""
    if loader.seq_len != model_config.max_seq_len:
        raise ValueError(f"the loader's seq_len={loader.seq_len} must equal the model's "
                         f"max_seq_len={model_config.max_seq_len}")
    if loader.batch_size != tc.batch_size:
        raise ValueError(f"the loader's batch_size={loader.batch_size} must equal the train config's "
                         f"batch_size={tc.batch_size}")
    if loader.vocab_size > model_config.vocab_size:
        raise ValueError(f"the corpus {loader.paths} was tokenized with a vocabulary of {loader.vocab_size} tokens; "
                         f"the model's vocab_size={model_config.vocab_size} is smaller (another tokenizer?)")


class _LoaderBatches:
    """This process's batches from a ``Loader``'s Grain iterator (its rows only), placed on the mesh."""

    def __init__(self, loader: Loader, start: int, mesh, model_config: TransformerConfig, ckpt: str, resumed: bool):
        self.rows = process_rows(mesh, loader.batch_size)
        self.loader, self.mesh, self.model_config = loader, mesh, model_config
        self.iterator = loader.iterator(self.rows, start)
        if resumed:  # the state saved with the checkpoint (absent when the process count changed)
            loader.verify_sources()  # the shards are still the ones the manifests describe
            checkpoints.restore_data_iterator(ckpt, start, self.iterator)

    def __call__(self, step: int):
        at = self.iterator.get_state().get("next_index")
        if at != step:  # a restored state that is not this step's (another loader, another Grain format)
            raise RuntimeError(f"the data iterator stands at batch {at}, the run at step {step}")
        return place_rows(next(self.iterator), self.rows, self.loader.batch_size, self.mesh, self.model_config)


# A run's train step, built once per process for equal configs and mesh: a resumed or repeated
# ``fit`` (a notebook, a sweep over data seeds) reuses the traced and compiled program. Small:
# each entry holds its executables.
@caches.lru_cache(maxsize=4)
def _train_step(model_config: TransformerConfig, tc: TrainConfig, mesh, plan):
    return make_train_step(model_config, make_optimizer(tc), mesh, plan=plan, loss_chunk=tc.loss_chunk,
                           max_logits=tc.log_max_logits)


def fit(
    model_config: TransformerConfig,
    tc: TrainConfig,
    stream: DataStream | Loader,
    run_dir: str,
    *,
    mesh=None,
    resume: bool = True,
    stop_after: int | None = None,
    on_log: Callable[[TrainState, dict], dict | None] | None = None,
    init_model: Transformer | None = None,
) -> TrainState:
    """Train for ``tc.steps`` steps (resuming from the newest checkpoint under ``run_dir/checkpoints``
    that verifies).

    Resuming is exact: the checkpoint holds parameters, optimiser state and step; batches and
    dropout keys are pure functions of (seed, step).

    ``stream`` is a ``DataStream`` (batches drawn by step) or a ``data.Loader`` (tokenized
    corpora): then each process reads its rows through the loader's Grain iterator (background
    prefetch), whose state goes into every checkpoint and is restored with it; the loader's
    ``seq_len``, ``batch_size`` and vocabulary must fit the model and ``tc``, and its sources and
    packing are part of the run's config. ``run_dir/config.json`` must match the
    given configs (else a ``ValueError`` names the differing fields), and metrics records past
    the checkpoint's step (written before an interruption) are dropped, so no step appears twice.
    A checkpoint is written every ``tc.checkpoint_every`` steps and at the end, atomically, with a
    checksum of every array; a resume skips (with a warning) every newer checkpoint whose files
    cannot be read or whose arrays do not match, moves it aside to ``<step>.corrupt``, and
    continues from the newest one that verifies; when none does it raises
    ``checkpoints.CheckpointCorruptError`` naming what is wrong, rather than start over.

    A loss or gradient norm that becomes NaN/Inf stops training with a ``FloatingPointError``
    naming the step, at the next log step and before any checkpoint would hold it.

    ``stop_after`` stops early after that many total steps (for tests of exact resumption);
    ``on_log(state, record)`` may return extra metrics (e.g. a held-out evaluation) to log.

    ``init_model`` starts a fresh run from these parameters instead of a random initialisation
    (a pretrained model: ``ringsplash.hf.load_hf(path, mesh=mesh)``, whose config may differ from
    ``model_config`` in anything but the parameter shapes, e.g. a new RoPE scaling or strategy);
    they are placed in the plan's shardings on ``mesh`` (multi-process: pass arrays on ``mesh``).
    A resumed run continues from its checkpoint and ignores it.

    The jitted initialisation and train step are built once per process for equal ``model_config``,
    ``tc`` (bookkeeping fields aside) and mesh: a second ``fit`` of the same run reuses them, compiled.
    """
    from tqdm.auto import tqdm

    loader = isinstance(stream, Loader)
    if loader:
        _check_loader(stream, model_config, tc)
    usp = model_config.attention == "usp" or tc.ulysses_parallel > 1
    mesh = mesh or make_mesh(tc.data_parallel, tc.context_parallel, ulysses=tc.ulysses_parallel if usp else None)
    plan = sharding_plan(model_config, mesh, tc.fsdp)
    step_fn = _train_step(model_config, program_config(tc), mesh, plan)
    ckpt = os.path.join(run_dir, "checkpoints")
    log = MetricsLog(run_dir)
    # A resumed run must be the run that wrote the checkpoint (checked before loading it);
    # bookkeeping fields may change.
    config_path = os.path.join(run_dir, "config.json")
    if not resume and os.path.exists(config_path) and is_main_process():
        os.remove(config_path)  # a fresh start may change the config
    _sync_processes("fresh run directory")
    run_config = {"model": model_config.to_dict(), "train": dataclasses.asdict(tc), "data_seed": stream.seed}
    if loader:
        run_config["data"] = stream.describe()
    check_run_config(config_path, run_config, ignore=tuple(f"train.{name}" for name in BOOKKEEPING_FIELDS))
    resumed = resume and checkpoints.latest_step(ckpt) is not None
    if resumed:
        # straight into the plan's shardings: each device reads its shards, no host holds the whole state;
        # the newest checkpoint that verifies (raises, naming each one, when none does: never a silent restart)
        state, skipped = resume_state(ckpt, model_config, tc, mesh, plan, stream.seed)
        if skipped and is_main_process():  # out of the way: the resumed run writes those steps again
            for bad, _ in skipped:
                warnings.warn(f"checkpoint step {bad} did not verify; moved to {checkpoints.set_aside(ckpt, bad)}",
                              RuntimeWarning, stacklevel=2)
        _sync_processes("damaged checkpoints set aside")
        if int(state.data_seed) != stream.seed:
            raise ValueError(f"checkpoint {ckpt} was written with data seed {int(state.data_seed)}, not {stream.seed}")
        model, opt_state = state.model, state.opt_state
    else:
        if init_model is None:  # created in place, sharded by the plan: never whole on one host
            state = init_sharded_state(model_config, tc, mesh, plan, stream.seed)
        else:
            state = start_from(init_model, model_config, tc, mesh, plan, stream.seed)
        model, opt_state = state.model, state.opt_state
    start = int(state.step)
    end = tc.steps if stop_after is None else min(tc.steps, stop_after)
    if is_main_process():
        log.truncate(after_step=start)  # no duplicate steps: records past the checkpoint are rewritten
    _sync_processes("run directory ready")  # nobody reads config.json / metrics while process 0 rewrites them
    schedule = learning_rate_schedule(tc)
    base_key = jax.random.key(tc.seed + 1)
    tokens_per_step = tc.batch_size * model_config.max_seq_len

    bar = tqdm(total=end, initial=start, desc="train", disable=not tc.progress or not is_main_process(),
               dynamic_ncols=True)
    window_start, window_steps = time.perf_counter(), 0
    if loader:
        draw = _LoaderBatches(stream, start, mesh, model_config, ckpt, resumed)
        data_iterator = draw.iterator
    else:
        draw = lambda step: stream_batch(stream, step, mesh, model_config)
        data_iterator = None
    next_batch = draw(start) if start < end else None
    pending = []  # (step, loss, grad_norm) of the steps not yet checked for NaN/Inf
    for i in range(start, end):
        batch = next_batch
        model, opt_state, metrics = step_fn(model, opt_state, batch, jax.random.fold_in(base_key, i))
        pending.append((i + 1, metrics["loss"], metrics["grad_norm"]))
        last = i + 1 == end
        save_now = tc.checkpoint_every and (i + 1) % tc.checkpoint_every == 0 and not last
        if i + 1 < end and not save_now:  # build the next batch on the host while the device works
            next_batch = draw(i + 1)
        window_steps += 1
        if (i + 1) % tc.log_every == 0 or last or i == start:
            _stop_if_nonfinite(pending, ckpt)
            pending = []
            metrics = jax.device_get(metrics)
            now = time.perf_counter()
            record = {"split": "train", "step": i + 1, "loss": float(metrics["loss"]),
                      "accuracy": float(metrics["accuracy"]), "grad_norm": float(metrics["grad_norm"]),
                      "lr": float(schedule(i)), "time": now}
            record.update(max_logit_metrics(metrics))
            if i > start:  # the first step includes compilation
                record["tokens_per_s"] = window_steps * tokens_per_step / (now - window_start)
            window_start, window_steps = now, 0
            state = TrainState(model, opt_state, jnp.asarray(i + 1, jnp.int32), state.data_seed)
            if on_log is not None:
                record.update(on_log(state, record) or {})
            log.write(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['accuracy']:.3f}",
                            tok_s=f"{record.get('tokens_per_s', 0):.0f}")
        bar.update(1)
        if save_now:  # the data iterator stands at batch i + 1, the step saved
            _stop_if_nonfinite(pending, ckpt)
            pending = []
            save_checkpoint(ckpt, TrainState(model, opt_state, jnp.asarray(i + 1, jnp.int32), state.data_seed),
                            data_iterator=data_iterator)
            next_batch = draw(i + 1)
    bar.close()
    state = TrainState(model, opt_state, jnp.asarray(max(end, start), jnp.int32), state.data_seed)
    save_checkpoint(ckpt, state, data_iterator=data_iterator)
    return state
