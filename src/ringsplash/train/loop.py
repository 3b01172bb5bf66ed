"""``fit``: a run. It checks the run's config, restores the latest checkpoint (or starts fresh), then
drives ``train_steps`` (``train.steps``) with hooks (``train.hooks``) that stop on NaN, log metrics,
show progress and checkpoint; a resumed run is bit-identical to an uninterrupted one."""

import dataclasses
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp

from ringsplash import checkpoints
from ringsplash._internal import caches
from ringsplash.data import BatchSource
from ringsplash.distributed import is_main_process
from ringsplash.model import Transformer, TransformerConfig
from ringsplash.train.config import (
    BOOKKEEPING_FIELDS,
    TrainConfig,
    learning_rate_schedule,
    make_optimizer,
    program_config,
)
from ringsplash.train.feed import Feed, check_source
from ringsplash.train.hooks import Checkpoints, Hook, LogMetrics, ProgressBar, StopIfNonfinite, as_hook
from ringsplash.train.mesh import mesh_for
from ringsplash.train.metrics import MetricsLog
from ringsplash.train.state import TrainState, check_run_config, init_sharded_state, resume_state, start_from
from ringsplash.train.step import make_train_step, sharding_plan
from ringsplash.train.steps import StepInfo, train_steps


def _sync_processes(name: str) -> None:
    """A barrier across processes (a no-op in a single-process run)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# A run's train step, built once per process for equal configs and mesh: a resumed or repeated
# ``fit`` (a notebook, a sweep over data seeds) reuses the traced and compiled program. Small:
# each entry holds its executables.
@caches.lru_cache(maxsize=4)
def _train_step(model_config: TransformerConfig, tc: TrainConfig, mesh, plan):
    return make_train_step(model_config, make_optimizer(tc), mesh, plan=plan, loss_chunk=tc.loss_chunk,
                           max_logits=tc.log_max_logits)


def _start_state(model_config: TransformerConfig, tc: TrainConfig, source: BatchSource, run_dir: str, log: MetricsLog,
                 mesh, plan, resume: bool, init_model: Transformer | None) -> tuple[TrainState, bool]:
    """(the run's first state, whether it was resumed): the run's config checked against
    ``run_dir/config.json``, then the newest checkpoint that verifies restored, or a fresh state;
    metrics records past its step dropped."""
    ckpt = os.path.join(run_dir, "checkpoints")
    # A resumed run must be the run that wrote the checkpoint (checked before loading it);
    # bookkeeping fields may change.
    config_path = os.path.join(run_dir, "config.json")
    if not resume and os.path.exists(config_path) and is_main_process():
        os.remove(config_path)  # a fresh start may change the config
    _sync_processes("fresh run directory")
    run_config = {"model": model_config.to_dict(), "train": dataclasses.asdict(tc), "data_seed": source.seed}
    if (data := source.describe()) is not None:
        run_config["data"] = data
    check_run_config(config_path, run_config, ignore=tuple(f"train.{name}" for name in BOOKKEEPING_FIELDS))
    resumed = resume and checkpoints.latest_step(ckpt) is not None
    if resumed:
        # straight into the plan's shardings: each device reads its shards, no host holds the whole state;
        # the newest checkpoint that verifies (raises, naming each one, when none does: never a silent restart)
        state, skipped = resume_state(ckpt, model_config, tc, mesh, plan, source.seed)
        if skipped and is_main_process():  # out of the way: the resumed run writes those steps again
            for bad, _ in skipped:
                warnings.warn(f"checkpoint step {bad} did not verify; moved to {checkpoints.set_aside(ckpt, bad)}",
                              RuntimeWarning, stacklevel=3)
        _sync_processes("damaged checkpoints set aside")
        if int(state.data_seed) != source.seed:
            raise ValueError(f"checkpoint {ckpt} was written with data seed {int(state.data_seed)}, not {source.seed}")
    elif init_model is None:  # created in place, sharded by the plan: never whole on one host
        state = init_sharded_state(model_config, tc, mesh, plan, source.seed)
    else:
        state = start_from(init_model, model_config, tc, mesh, plan, source.seed)
    if is_main_process():
        log.truncate(after_step=int(state.step))  # no duplicate steps: those past it are rewritten
    _sync_processes("run directory ready")  # nobody reads config.json / metrics while process 0 rewrites them
    return state, resumed


def run_hooks(steps: Iterator[StepInfo], hooks: Sequence[Hook], state: TrainState) -> TrainState:
    """Run every hook on each step of ``steps`` (until the last, or one returns ``True``), then
    ``on_end`` of each with the final state (``state`` when there is no step), which it returns."""
    last = None
    for last in steps:
        stops = [hook.on_step(last) for hook in hooks]  # every hook sees the step
        if any(stop is True for stop in stops):
            break
    steps.close()
    state = TrainState(state.model, state.opt_state, jnp.asarray(int(state.step), jnp.int32), state.data_seed) \
        if last is None else last.state
    for hook in hooks:
        hook.on_end(state)
    return state


def fit(
    model_config: TransformerConfig,
    tc: TrainConfig,
    stream: BatchSource,
    run_dir: str,
    *,
    mesh=None,
    resume: bool = True,
    stop_after: int | None = None,
    on_log: Callable[[TrainState, dict], dict | None] | None = None,
    init_model: Transformer | None = None,
    hooks: Iterable[Hook | Callable[[StepInfo], bool | None]] = (),
) -> TrainState:
    """Train for ``tc.steps`` steps (resuming from the newest checkpoint under ``run_dir/checkpoints``
    that verifies).

    Resuming is exact: the checkpoint holds parameters, optimiser state and step; batches and
    dropout keys are pure functions of (seed, step).

    ``stream`` is any ``data.BatchSource``: a ``DataStream`` (batches drawn by step, each checked
    against the model's vocabulary) or a ``data.Loader`` (tokenized corpora): each process reads its
    rows through the source's iterator (a Loader's: Grain, background prefetch), whose state goes
    into every checkpoint and is restored with it when the source is ``stateful``; a loader's
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
    ``hooks`` (``train.hooks``: objects with ``on_step(info)`` / ``on_end(state)``, or functions of
    the ``StepInfo``) run after each step, after the NaN check and before the metrics are logged;
    one that returns ``True`` ends the run after that step (with a final checkpoint).

    ``init_model`` starts a fresh run from these parameters instead of a random initialisation
    (a pretrained model: ``ringsplash.hf.load_hf(path, mesh=mesh)``, whose config may differ from
    ``model_config`` in anything but the parameter shapes, e.g. a new RoPE scaling or strategy);
    they are placed in the plan's shardings on ``mesh`` (multi-process: pass arrays on ``mesh``).
    A resumed run continues from its checkpoint and ignores it.

    The jitted initialisation and train step are built once per process for equal ``model_config``,
    ``tc`` (bookkeeping fields aside) and mesh: a second ``fit`` of the same run reuses them, compiled.
    """
    check_source(stream, model_config, tc)  # before any work
    mesh = mesh or mesh_for(model_config, tc.data_parallel)
    plan = sharding_plan(model_config, mesh, tc.fsdp)
    step_fn = _train_step(model_config, program_config(tc), mesh, plan)
    ckpt = os.path.join(run_dir, "checkpoints")
    log = MetricsLog(run_dir)
    state, resumed = _start_state(model_config, tc, stream, run_dir, log, mesh, plan, resume, init_model)
    start = int(state.step)
    end = tc.steps if stop_after is None else min(tc.steps, stop_after)
    metrics = LogMetrics(log, learning_rate_schedule(tc), tc.batch_size * model_config.max_seq_len,
                         tc.log_every, extra=on_log)
    bar = ProgressBar(end, start, tc.progress and is_main_process(), metrics)
    feed = Feed(stream, start, mesh, model_config, resumed_from=ckpt if resumed else None)
    saves = Checkpoints(ckpt, tc.checkpoint_every, feed)
    nonfinite = StopIfNonfinite(ckpt, when=lambda info: metrics.due(info) or saves.due(info))
    steps = train_steps(step_fn, state, feed, end, key=jax.random.key(tc.seed + 1), hold=saves.due)
    return run_hooks(steps, [nonfinite, *map(as_hook, hooks), metrics, bar, saves], state)
