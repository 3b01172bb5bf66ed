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

from ringsplash import checkpoints
from ringsplash.data import DataStream
from ringsplash.distributed import is_main_process
from ringsplash.model import Transformer, TransformerConfig
from ringsplash.train.batches import stream_batch
from ringsplash.train.config import TrainConfig, learning_rate_schedule, make_optimizer
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


def fit(
    model_config: TransformerConfig,
    tc: TrainConfig,
    stream: DataStream,
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
    dropout keys are pure functions of (seed, step). ``run_dir/config.json`` must match the
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
    """
    from tqdm.auto import tqdm

    usp = model_config.attention == "usp" or tc.ulysses_parallel > 1
    mesh = mesh or make_mesh(tc.data_parallel, tc.context_parallel, ulysses=tc.ulysses_parallel if usp else None)
    optimizer = make_optimizer(tc)
    plan = sharding_plan(model_config, mesh, tc.fsdp)
    step_fn = make_train_step(model_config, optimizer, mesh, plan=plan, loss_chunk=tc.loss_chunk,
                              max_logits=tc.log_max_logits)
    ckpt = os.path.join(run_dir, "checkpoints")
    log = MetricsLog(run_dir)
    # A resumed run must be the run that wrote the checkpoint (checked before loading it);
    # bookkeeping fields may change.
    config_path = os.path.join(run_dir, "config.json")
    if not resume and os.path.exists(config_path) and is_main_process():
        os.remove(config_path)  # a fresh start may change the config
    _sync_processes("fresh run directory")
    check_run_config(config_path,
                     {"model": model_config.to_dict(), "train": dataclasses.asdict(tc), "data_seed": stream.seed},
                     ignore=("train.progress", "train.checkpoint_every", "train.log_every"))
    if resume and checkpoints.latest_step(ckpt) is not None:
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
    next_batch = stream_batch(stream, start, mesh, model_config) if start < end else None
    pending = []  # (step, loss, grad_norm) of the steps not yet checked for NaN/Inf
    for i in range(start, end):
        batch = next_batch
        model, opt_state, metrics = step_fn(model, opt_state, batch, jax.random.fold_in(base_key, i))
        pending.append((i + 1, metrics["loss"], metrics["grad_norm"]))
        if i + 1 < end:  # build the next batch on the host while the device works
            next_batch = stream_batch(stream, i + 1, mesh, model_config)
        window_steps += 1
        last = i + 1 == end
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
        if tc.checkpoint_every and (i + 1) % tc.checkpoint_every == 0 and not last:
            _stop_if_nonfinite(pending, ckpt)
            pending = []
            save_checkpoint(ckpt, TrainState(model, opt_state, jnp.asarray(i + 1, jnp.int32), state.data_seed))
    bar.close()
    state = TrainState(model, opt_state, jnp.asarray(max(end, start), jnp.int32), state.data_seed)
    save_checkpoint(ckpt, state)
    return state
