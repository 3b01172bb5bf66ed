"""``TrainConfig`` (optimiser, schedule, data parallelism and bookkeeping of one run) and the
AdamW optimiser on a linear-warmup + cosine-decay learning-rate schedule. The context parallelism
is the model's (``TransformerConfig.context_parallel``): the trainer's mesh is built from both."""

import dataclasses
import inspect
import warnings

import optax

from ringsplash._internal.scalar_checks import (
    check_bool,
    check_divides,
    check_float,
    check_int,
    check_positive_int,
    plain_fields,
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimiser, schedule, data parallelism and bookkeeping of one training run (the mesh is
    ``data_parallel`` rows x the model's ``context_parallel`` axes: ``train.mesh_for``)."""

    steps: int = 1000
    batch_size: int = 8  # global rows per step
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.98
    grad_clip: float | None = 1.0  # clip the global gradient norm to this (> 0); None: no clipping
    data_parallel: int = 1
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 0  # 0: only at the end
    progress: bool = True
    fsdp: bool = True  # shard params + optimiser state over data x context (a no-op on one device)
    loss_chunk: int = 0  # tokens per chunk of the cross-entropy (0: all local tokens at once)
    log_max_logits: bool = False  # collect + log per-layer max logits (always on with qk_clip_threshold)

    def __post_init__(self):
        plain_fields(self)  # NumPy / JAX scalars as Python numbers: run directories write this config as JSON
        for name in ("steps", "batch_size", "data_parallel", "log_every"):
            check_positive_int(name, getattr(self, name))
        check_divides("data_parallel", self.data_parallel, "batch_size", self.batch_size)
        if not 0 <= check_int("warmup_steps", self.warmup_steps) <= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be in [0, steps={self.steps}]")
        check_int("loss_chunk", self.loss_chunk, minimum=0)
        check_int("checkpoint_every", self.checkpoint_every, minimum=0)
        check_int("seed", self.seed)
        check_float("learning_rate", self.learning_rate, minimum=0.0)  # 0: parameters frozen (tests, probes)
        check_float("min_lr_ratio", self.min_lr_ratio, minimum=0.0, maximum=1.0)
        check_float("weight_decay", self.weight_decay, minimum=0.0)
        for name in ("b1", "b2"):
            if not 0.0 <= check_float(name, getattr(self, name)) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {name}={getattr(self, name)!r}")
        if self.grad_clip is not None:
            check_float("grad_clip", self.grad_clip, positive=True)  # None switches clipping off
        for name in ("progress", "fsdp", "log_max_logits"):
            check_bool(name, getattr(self, name))


    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """The config of ``dataclasses.asdict(tc)`` (a run directory's ``train`` entry; one of the
        previous release, with its context-parallel degrees, too)."""
        return cls(**{k: v for k, v in d.items() if k not in OLD_TRAIN_FIELDS})


#: ``TrainConfig`` fields of the previous release: the model's ``context_parallel`` holds them now
OLD_TRAIN_FIELDS = ("context_parallel", "ulysses_parallel")
_dataclass_init = TrainConfig.__init__


def _init(self, *args, **kwargs):  # the old fields are accepted (and ignored) for one release
    old = {k: kwargs.pop(k) for k in OLD_TRAIN_FIELDS if k in kwargs}
    if old:
        warnings.warn(f"TrainConfig{tuple(old)} is deprecated and ignored (removed in the next release): the "
                      f"trainer's mesh takes its context axes from the model, TransformerConfig.context_parallel "
                      f"(e.g. ContextParallel('ring', ring_size=4)); TrainConfig keeps data_parallel only",
                      DeprecationWarning, stacklevel=2)
    _dataclass_init(self, *args, **kwargs)


_init.__doc__, _init.__signature__ = _dataclass_init.__doc__, inspect.signature(_dataclass_init)
TrainConfig.__init__ = _init

#: fields of ``TrainConfig`` that never enter a compiled program (nor the check of a resumed run's config)
BOOKKEEPING_FIELDS = ("log_every", "checkpoint_every", "progress")


def program_config(tc: TrainConfig) -> TrainConfig:
    """``tc`` with its bookkeeping fields at their defaults: equal for two runs whose programs are
    the same, so it keys the caches of a run's jitted programs."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in BOOKKEEPING_FIELDS}
    return dataclasses.replace(tc, **defaults)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW on a linear-warmup + cosine-decay schedule (to ``min_lr_ratio * learning_rate``)."""
    return optax.chain(
        optax.clip_by_global_norm(tc.grad_clip) if tc.grad_clip is not None else optax.identity(),
        optax.adamw(learning_rate_schedule(tc), b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay),
    )


def learning_rate_schedule(tc: TrainConfig) -> optax.Schedule:
    """Linear warmup over ``warmup_steps`` to ``learning_rate``, then cosine decay to
    ``min_lr_ratio * learning_rate`` at ``steps``."""
    return optax.warmup_cosine_decay_schedule(
        0.0, tc.learning_rate, max(tc.warmup_steps, 1), max(tc.steps, tc.warmup_steps + 2),
        tc.learning_rate * tc.min_lr_ratio,
    )
