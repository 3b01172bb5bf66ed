"""The ring schedule a model's attention runs with: one per (config, sequence length, mesh).

Under the ``"ring"`` strategy (and ``"usp"``, whose inner ring runs over the ring axis on
``heads / ulysses`` heads) every layer's ring reads the same work lists (one mask per model).
Left to itself, ``ring_attention`` bakes the whole ``[lists, N, N, steps]`` schedule into the
program as a constant replicated on every device; the trainer instead builds it here once on
the host, sharded over the ring axis (each process builds only its devices' rows), and passes
it into its ``jit`` as an argument and into ``shard_map`` with ``schedule.specs(ring axis)``,
so each device holds its own q shard's rows: 1/N of it (``Transformer.hidden(schedule=)``).
With ``layer_types`` each layer type has its own mask, so the schedule is a dict of one
``RingSchedule`` per layer type (``schedule_specs`` gives its ``shard_map`` specs either way).
"""

import functools

import jax
from jax.sharding import PartitionSpec as P

from ringsplash.model.config import TransformerConfig
from ringsplash.parallel.heads import local_head_mask, ulysses_heads
from ringsplash.parallel.ring_plan import RingSchedule, ring_schedule
from ringsplash.parallel.usp import usp_ring_config

__all__ = ["model_ring_schedule", "schedule_bytes_per_device", "schedule_specs", "uses_ring_schedule"]


def uses_ring_schedule(config: TransformerConfig) -> bool:
    """Whether ``config``'s attention strategy runs a ring that takes a ``RingSchedule``."""
    return config.context_parallel.rule.ring_schedule


def model_ring_schedule(config: TransformerConfig, seq_len: int, mesh: jax.sharding.Mesh, *,
                        shapes_only: bool = False,
                        segment_ids: bool = False) -> RingSchedule | dict[str, RingSchedule] | None:
    """The (cached) ring schedule of ``config``'s attention at ``seq_len`` tokens on ``mesh``:
    global arrays sharded ``P(None, ring axis)`` (``shapes_only``: ``ShapeDtypeStruct`` s for AOT
    lowering); a dict ``{layer type: RingSchedule}`` when ``config.features.layer_types`` is set; None for
    strategies without a ring (``uses_ring_schedule``).

    Args:
        config: the model's config (strategy, mask, heads, ring size / layout, ``SplashConfig``).
        seq_len: the global sequence length S of the batch.
        mesh: the trainer's mesh; its ring axis is ``config.context_parallel.ring_axis``.
        shapes_only: shapes and shardings only, no arrays.
        segment_ids: whether the batches carry segment ids (packed documents): the ring's blocks
            left at None are tuned for sparse calls then (``parallel.ring_tuning.ring_config``).
    """
    if not uses_ring_schedule(config):
        return None
    if config.features.layer_types is None:
        return _cached(config, int(seq_len), mesh, bool(shapes_only), None, bool(segment_ids))
    return {kind: _cached(config, int(seq_len), mesh, bool(shapes_only), kind, bool(segment_ids))
            for kind in config.attention_kinds}


def schedule_specs(schedule: RingSchedule | dict[str, RingSchedule] | None, axis_name: str | None):
    """``shard_map`` specs of a model's ring schedule (``model_ring_schedule``): each device takes its q
    shard's rows (``RingSchedule.specs``)."""
    return None if schedule is None else jax.tree.map(lambda _: P(None, axis_name), schedule)


def schedule_bytes_per_device(schedule: RingSchedule | dict[str, RingSchedule] | None) -> int:
    """Bytes of one device's slice of a model's ring schedule (every layer type's; 0 for None)."""
    if schedule is None:
        return 0
    return sum(s.nbytes_per_device for s in (schedule.values() if isinstance(schedule, dict) else [schedule]))


@functools.lru_cache(maxsize=8)  # small: each entry holds device arrays (1/N of the schedule per device)
def _cached(config: TransformerConfig, seq_len: int, mesh, shapes_only: bool, layer_type,
            segment_ids: bool) -> RingSchedule:
    mask = config.make_mask(seq_len, layer_type)
    heads, kv_heads = config.num_heads, config.num_kv_heads
    cp = config.context_parallel
    splash = config.splash
    if "ulysses" in cp.roles:  # USP: the inner ring sees the Ulysses rank's heads and config (usp_attention)
        split = ulysses_heads(heads, kv_heads, cp.ulysses_size, cp.ulysses_axis)
        heads, kv_heads, mask = split.q_local, split.kv_local, local_head_mask(mask, split)
        splash = usp_ring_config(splash, cp.ring_size)
    return ring_schedule(mask, cp.ring_size, cp.layout, splash, heads=heads, kv_heads=kv_heads,
                         mesh=mesh, axis_name=cp.ring_axis, shapes_only=shapes_only, head_dim=config.head_dim,
                         dtype=config.compute_dtype, segment_ids=segment_ids)
