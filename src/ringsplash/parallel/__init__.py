"""Context parallelism over mesh axes, every strategy on the same Splash kernels.

``ring`` (scan ring; its host plan and per-device schedules in ``ring_plan``), ``allgather`` (Llama-3: gather K/V),
``ulysses`` (all-to-all sequence <-> heads), ``usp`` (Ulysses inside, ring across, 2-D mesh).
Each has ``*_attention`` (inside ``jax.shard_map``) and ``*_attention_sharded`` (global arrays).
"""

from ringsplash.parallel.allgather import (
    allgather_attention,
    allgather_attention_sharded,
)
from ringsplash.parallel.ring import RingAttention, make_ring_attention, ring_attention, ring_attention_sharded
from ringsplash.parallel.ring_plan import RingSchedule, ring_schedule
from ringsplash.parallel.ulysses import ulysses_attention, ulysses_attention_sharded
from ringsplash.parallel.usp import usp_attention, usp_attention_sharded, usp_mesh

__all__ = [
    "RingAttention",
    "RingSchedule",
    "allgather_attention",
    "allgather_attention_sharded",
    "make_ring_attention",
    "ring_attention",
    "ring_attention_sharded",
    "ring_schedule",
    "ulysses_attention",
    "ulysses_attention_sharded",
    "usp_attention",
    "usp_attention_sharded",
    "usp_mesh",
]
