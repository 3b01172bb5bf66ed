"""Training: AdamW with warmup + cosine on a ``("data", "context"[, "ulysses"])`` mesh, batches
laid out for the model's context-parallel strategy, a ``shard_map`` train step with FSDP and a
chunked loss, sharded checkpoints with exact resumption, metrics, and ``fit``: a driver that runs
hooks (``train.hooks``: NaN stop, metrics, progress, checkpoints, evaluation) over the steps of
``train_steps`` (``train.steps``), fed by any ``data.BatchSource`` (``train.feed``)."""

from ringsplash.data import Batch
from ringsplash.train.batches import (
    layout_batch,
    pad_batch,
    process_rows,
    replicate,
    shard_batch,
    stream_batch,
    unlayout,
)
from ringsplash.train.config import TrainConfig, learning_rate_schedule, make_optimizer
from ringsplash.train.feed import Feed
from ringsplash.train.hooks import Checkpoints, Evaluate, Hook, LogMetrics, ProgressBar, StopIfNonfinite
from ringsplash.train.loop import fit
from ringsplash.train.mesh import CONTEXT, DATA, ULYSSES, batch_spec, check_mesh, make_mesh, mesh_axes, mesh_for
from ringsplash.train.metrics import MetricsLog, max_logit_metrics, plot_metrics
from ringsplash.train.state import (
    TrainState,
    abstract_state,
    check_run_config,
    init_sharded_state,
    init_state,
    load_checkpoint,
    place_state,
    restore_sharded_state,
    resume_state,
    save_checkpoint,
    sharded_init_fn,
    start_from,
    state_digest,
    upgrade_run_config,
)
from ringsplash.train.step import (
    batch_ring_schedule,
    chunked_loss_sums,
    evaluate,
    make_eval_step,
    make_grad_fn,
    make_logits_fn,
    make_train_step,
    sharding_plan,
)
from ringsplash.train.steps import StepInfo, train_steps

__all__ = [
    "CONTEXT",
    "DATA",
    "ULYSSES",
    "Batch",
    "Checkpoints",
    "Evaluate",
    "Feed",
    "Hook",
    "LogMetrics",
    "MetricsLog",
    "ProgressBar",
    "StepInfo",
    "StopIfNonfinite",
    "TrainConfig",
    "TrainState",
    "abstract_state",
    "batch_ring_schedule",
    "batch_spec",
    "check_mesh",
    "check_run_config",
    "chunked_loss_sums",
    "evaluate",
    "fit",
    "init_sharded_state",
    "init_state",
    "layout_batch",
    "learning_rate_schedule",
    "load_checkpoint",
    "make_eval_step",
    "make_grad_fn",
    "make_logits_fn",
    "make_mesh",
    "make_optimizer",
    "make_train_step",
    "max_logit_metrics",
    "mesh_axes",
    "mesh_for",
    "pad_batch",
    "place_state",
    "plot_metrics",
    "process_rows",
    "replicate",
    "restore_sharded_state",
    "resume_state",
    "save_checkpoint",
    "shard_batch",
    "sharded_init_fn",
    "sharding_plan",
    "start_from",
    "state_digest",
    "stream_batch",
    "train_steps",
    "unlayout",
    "upgrade_run_config",
]
