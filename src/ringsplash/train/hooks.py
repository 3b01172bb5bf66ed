"""Hooks: what ``fit`` does around each step of ``train_steps``. A hook has ``on_step(info)``
(after every step, ``info`` a ``StepInfo``; returning ``True`` stops training after that step) and
``on_end(state)`` (once, with the final state, when training ends without an error). The
built-ins, in the order ``fit`` runs them (your hooks run after the NaN stop, before logging):

* ``StopIfNonfinite`` raises at the first NaN/Inf loss or gradient norm (checked only when a
  record or a checkpoint is about to be written: no synchronisation per step);
* ``LogMetrics`` writes the train record (loss, accuracy, gradient norm, learning rate, tokens/s)
  every ``log_every`` steps, the first and the last;
* ``ProgressBar`` (tqdm, with the latest record's loss, accuracy and tokens/s);
* ``Checkpoints`` saves every ``checkpoint_every`` steps and at the end.

``Evaluate`` (a held-out evaluation every N steps, as ``split="eval"`` records) is installed by
the caller: ``fit(..., hooks=[Evaluate(...)])``."""

import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import jax
import numpy as np

from ringsplash import checkpoints
from ringsplash.train.feed import Feed
from ringsplash.train.metrics import MetricsLog, max_logit_metrics
from ringsplash.train.state import TrainState, save_checkpoint
from ringsplash.train.steps import StepInfo


@runtime_checkable
class Hook(Protocol):
    """The hook protocol. Subclass it to inherit doing nothing and override what you need (or pass
    ``fit`` a plain function of the ``StepInfo``, run as ``on_step``)."""

    def on_step(self, info: StepInfo) -> bool | None:
        """After each step; ``True`` stops training after it (``on_end`` then sees that state). Every
        process runs every hook: one that stops must decide alike on all (checkpoints are collective)."""
        return None

    def on_end(self, state: TrainState) -> None:
        """Once, after the last step (also when a hook stopped training), before ``fit`` returns."""


class _Function(Hook):
    def __init__(self, fn: Callable[[StepInfo], bool | None]):
        self.fn = fn

    def on_step(self, info: StepInfo) -> bool | None:
        return self.fn(info)


def as_hook(hook: Hook | Callable[[StepInfo], bool | None]) -> Hook:
    """``hook`` itself when it has ``on_step`` and ``on_end`` (a ``Hook``), else the function as a hook."""
    if isinstance(hook, Hook):
        return hook
    if callable(hook):
        return _Function(hook)
    raise TypeError(f"a hook must have on_step(info) and on_end(state) or be a function of the StepInfo, got {hook!r}")


class StopIfNonfinite(Hook):
    """Raise a ``FloatingPointError`` naming the first step whose loss or gradient norm is NaN/Inf,
    and the newest checkpoint under ``ckpt``: the steps' scalars are fetched only at steps ``when``
    is true for (and at the end), so before any record or checkpoint could hold the damage."""

    def __init__(self, ckpt: str, when: Callable[[StepInfo], bool]):
        self.ckpt, self.when = ckpt, when
        self.pending = []  # (step, loss, grad_norm) device scalars not yet checked

    def on_step(self, info: StepInfo) -> None:
        self.pending.append((info.step, info.metrics["loss"], info.metrics["grad_norm"]))
        if self.when(info):
            self.check()

    def on_end(self, state: TrainState) -> None:
        self.check()

    def check(self) -> None:
        pending, self.pending = self.pending, []
        for step, loss, grad_norm in jax.device_get(pending):
            if np.isfinite(loss) and np.isfinite(grad_norm):
                continue
            latest = checkpoints.latest_step(self.ckpt)
            raise FloatingPointError(
                f"training stopped: the loss or gradient norm is NaN/Inf at step {step}; "
                + (f"the newest checkpoint ({self.ckpt}, step {latest}) predates it" if latest is not None
                   else "no checkpoint was written")
                + " (lower the learning rate, check the data and the restored weights)"
            )


class LogMetrics(Hook):
    """The train record of every ``every``-th step, the first and the last, to ``log``;
    ``extra(state, record)`` may return more fields (e.g. a held-out evaluation). ``record`` is
    this step's record (``None`` at a step not logged)."""

    def __init__(self, log: MetricsLog, schedule: Callable, tokens_per_step: int, every: int,
                 extra: Callable[[TrainState, dict], dict | None] | None = None):
        self.log, self.schedule, self.tokens_per_step, self.every, self.extra = (
            log, schedule, tokens_per_step, every, extra)
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.record = None

    def due(self, info: StepInfo) -> bool:
        return info.step % self.every == 0 or info.last or info.first

    def on_step(self, info: StepInfo) -> None:
        self.window_steps += 1
        self.record = None
        if not self.due(info):
            return
        metrics = jax.device_get(info.metrics)
        now = time.perf_counter()
        record = {"split": "train", "step": info.step, "loss": float(metrics["loss"]),
                  "accuracy": float(metrics["accuracy"]), "grad_norm": float(metrics["grad_norm"]),
                  "lr": float(self.schedule(info.step - 1)), "time": now}
        record.update(max_logit_metrics(metrics))
        if not info.first:  # the first step includes compilation
            record["tokens_per_s"] = self.window_steps * self.tokens_per_step / (now - self.window_start)
        self.window_start, self.window_steps = now, 0
        if self.extra is not None:
            record.update(self.extra(info.state, record) or {})
        self.log.write(record)
        self.record = record


class ProgressBar(Hook):
    """A tqdm bar from step ``initial`` to ``total``, showing ``metrics``' latest record."""

    def __init__(self, total: int, initial: int, enabled: bool, metrics: LogMetrics | None = None):
        from tqdm.auto import tqdm

        self.metrics = metrics
        self.bar = tqdm(total=total, initial=initial, desc="train", disable=not enabled, dynamic_ncols=True)

    def on_step(self, info: StepInfo) -> None:
        record = self.metrics.record if self.metrics is not None else None
        if record is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['accuracy']:.3f}",
                                 tok_s=f"{record.get('tokens_per_s', 0):.0f}")
        self.bar.update(1)

    def on_end(self, state: TrainState) -> None:
        self.bar.close()


class Checkpoints(Hook):
    """A checkpoint under ``ckpt`` every ``every`` steps (0: none) and of the final state, each with
    the feed's data-iterator state when its source is stateful (standing at the step saved)."""

    def __init__(self, ckpt: str, every: int, feed: Feed):
        self.ckpt, self.every, self.feed = ckpt, every, feed

    def due(self, info: StepInfo) -> bool:
        """A periodic checkpoint (the last step's is the final one, written by ``on_end``)."""
        return bool(self.every) and info.step % self.every == 0 and not info.last

    def on_step(self, info: StepInfo) -> None:
        if self.due(info):
            save_checkpoint(self.ckpt, info.state, data_iterator=self.feed.iterator_at(info.step))

    def on_end(self, state: TrainState) -> None:
        save_checkpoint(self.ckpt, state, data_iterator=self.feed.iterator_at(int(state.step)))


class Evaluate(Hook):
    """Every ``every`` steps and at the last, ``evaluate(state) -> dict`` (e.g. ``train.evaluate`` on
    a held-out stream) written to ``log`` as ``{"split": "eval", "step": ..., **result}``."""

    def __init__(self, every: int, evaluate: Callable[[TrainState], dict], log: MetricsLog):
        self.every, self.evaluate, self.log = every, evaluate, log

    def on_step(self, info: StepInfo) -> None:
        if info.step % self.every == 0 or info.last:
            self.log.write({"split": "eval", "step": info.step, **self.evaluate(info.state)})
