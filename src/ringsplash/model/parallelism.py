"""``ContextParallel``: how a model's attention strategy shards the sequence over mesh axes.

The one place that knows which axes a strategy uses (the ring's, the Ulysses all-to-all's, or
both for USP, ring-major), their sizes, the token layout's shard count and the batch
``PartitionSpec``; the model's attention and the trainer both read it.
"""

import dataclasses
from typing import Literal

from jax.sharding import PartitionSpec as P

from ringsplash import layouts
from ringsplash._scalar_checks import check_positive_int

Strategy = Literal["reference", "splash", "ring", "allgather", "ulysses", "usp"]
#: the two roles a mesh axis plays for context parallelism
Role = Literal["ring", "ulysses"]
#: strategies that shard the sequence over ``ring_axis_name`` / over ``ulysses_axis_name``
RING_AXIS_STRATEGIES: tuple[str, ...] = ("ring", "allgather", "usp")
ULYSSES_AXIS_STRATEGIES: tuple[str, ...] = ("ulysses", "usp")

__all__ = ["RING_AXIS_STRATEGIES", "ULYSSES_AXIS_STRATEGIES", "ContextParallel", "Role", "Strategy"]


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """The context parallelism of one strategy: its mesh axes (``ring_axis`` of ``ring_size``
    devices for ring / all-gather / USP's ring, ``ulysses_axis`` of ``ulysses_size`` for Ulysses /
    USP's all-to-all) and the ``layout`` the sequence is permuted into. Build it from a model
    config with ``TransformerConfig.context_parallel`` (which validates the combination)."""

    strategy: Strategy
    ring_axis: str | None = None
    ring_size: int = 1
    ulysses_axis: str | None = None
    ulysses_size: int = 1
    layout: layouts.Layout = "zigzag"

    def __post_init__(self):
        check_positive_int("ring_size", self.ring_size)
        check_positive_int("ulysses_size", self.ulysses_size)
        for role in self.roles:
            if not self.axis(role):
                raise ValueError(f"strategy={self.strategy!r} needs {role}_axis (a mesh axis name), got None")

    @classmethod
    def from_config(cls, config) -> "ContextParallel":
        """The context parallelism of a ``TransformerConfig``."""
        return cls(config.attention, config.ring_axis_name, config.ring_size, config.ulysses_axis_name,
                   config.ulysses_size, config.ring_layout)

    @property
    def roles(self) -> tuple[Role, ...]:
        """The axis roles the strategy uses, ring first (USP's local shards are ring-major):
        ``("ring",)``, ``("ulysses",)``, ``("ring", "ulysses")`` for USP, ``()`` on one device."""
        ring = ("ring",) if self.strategy in RING_AXIS_STRATEGIES else ()
        return ring + (("ulysses",) if self.strategy in ULYSSES_AXIS_STRATEGIES else ())

    def axis(self, role: Role) -> str | None:
        """The mesh axis of ``role``."""
        return self.ring_axis if role == "ring" else self.ulysses_axis

    def size(self, role: Role) -> int:
        """The devices on the axis of ``role``."""
        return self.ring_size if role == "ring" else self.ulysses_size

    def axes(self) -> dict[str, int]:
        """The mesh axes the sequence is sharded over with their sizes, ring first; empty
        without context parallelism."""
        return {self.axis(role): self.size(role) for role in self.roles}

    @property
    def shards(self) -> int:
        """Devices the sequence is sharded over (1 without context parallelism)."""
        return self.ring_size * self.ulysses_size

    @property
    def layout_shards(self) -> int:
        """Shards of the ``layout`` permutation: ``ulysses_size`` for Ulysses, else ``ring_size``
        (USP's inner ring sees ``ring_size`` shards)."""
        return self.ulysses_size if self.strategy == "ulysses" else self.ring_size

    def with_axes(self, *names: str) -> "ContextParallel":
        """The same parallelism on other mesh axes: the used roles, ring first, take ``names``."""
        return dataclasses.replace(self, **{f"{role}_axis": name for role, name in zip(self.roles, names)})

    def batch_spec(self, data_axis: str | None) -> P:
        """``PartitionSpec`` of a ``[batch, seq]`` array: rows over ``data_axis``, the sequence over
        the strategy's axes (USP: ring-major ``(ring, ulysses)``)."""
        axes = tuple(self.axes())
        return P(data_axis, None if not axes else axes[0] if len(axes) == 1 else axes)
