"""``ContextParallel``: the attention strategy of a model and how it shards the sequence over mesh axes.

The one home of the strategies' rules: which axes each uses (the ring's, the Ulysses all-to-all's,
or both for USP, ring-major) with their sizes and default names (the trainer's mesh axes), the
token layout, the sequence lengths each runs at, and the changes of strategy (``single_device``,
``on_axis``). ``TransformerConfig.context_parallel`` holds one; the model's attention dispatches on
``strategy`` (``model.attention.LOCAL_ATTENTION``) and the trainer builds its mesh from it.
"""

import dataclasses
import math
from typing import Literal, NamedTuple

from jax.sharding import PartitionSpec as P

from ringsplash import layouts
from ringsplash._internal.scalar_checks import (
    as_scalar,
    check_choice,
    check_name,
    check_positive_int,
    literal_choices,
    plain_fields,
)
from ringsplash.parallel.heads import usp_factorisations, valid_ulysses_degrees
from ringsplash.parallel.ring_plan import fit_ring_blocks
from ringsplash.splash.blocks import Extent, fit_blocks
from ringsplash.splash.config import NUM_LANES, SplashConfig

Strategy = Literal["reference", "splash", "ring", "allgather", "ulysses", "usp"]
STRATEGIES: tuple[str, ...] = literal_choices(Strategy)
#: the two roles a mesh axis plays for context parallelism
Role = Literal["ring", "ulysses"]
#: the default mesh axis of each role, ring-major (the trainer's mesh, ``train.mesh_for``): a strategy's
#: first role runs over ``CONTEXT``, USP's all-to-all over ``ULYSSES``
CONTEXT, ULYSSES = "context", "ulysses"


class StrategyRule(NamedTuple):
    """What the rest of the library needs to know about one strategy."""

    roles: tuple[Role, ...]  # the mesh axes it shards the sequence over, ring first
    ring_schedule: bool = False  # runs a ring that takes a ``RingSchedule`` (and names its own residuals)
    single_device: bool = False  # runs on one device, outside ``shard_map``


#: every strategy's rule: adding a strategy is one entry here, one in ``model.attention.LOCAL_ATTENTION``
#: (its call inside ``shard_map``) and, if its lengths differ, a case of ``ContextParallel.check_seq_len``
RULES: dict[str, StrategyRule] = {
    "reference": StrategyRule((), single_device=True),
    "splash": StrategyRule((), single_device=True),
    "ring": StrategyRule(("ring",), ring_schedule=True),
    "allgather": StrategyRule(("ring",)),
    "ulysses": StrategyRule(("ulysses",)),
    "usp": StrategyRule(("ring", "ulysses"), ring_schedule=True),
}
#: strategies that shard the sequence over ``ring_axis`` / over ``ulysses_axis``
RING_AXIS_STRATEGIES: tuple[str, ...] = tuple(s for s, r in RULES.items() if "ring" in r.roles)
ULYSSES_AXIS_STRATEGIES: tuple[str, ...] = tuple(s for s, r in RULES.items() if "ulysses" in r.roles)
SINGLE_DEVICE_STRATEGIES: tuple[str, ...] = tuple(s for s, r in RULES.items() if r.single_device)

__all__ = ["CONTEXT", "RING_AXIS_STRATEGIES", "RULES", "SINGLE_DEVICE_STRATEGIES", "STRATEGIES", "ULYSSES",
           "ULYSSES_AXIS_STRATEGIES", "ContextParallel", "Role", "Strategy", "StrategyRule"]


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """The attention ``strategy`` and its context parallelism (a frozen, hashable value):

    * ``"splash"`` (the default) / ``"reference"``: one device (block-sparse Splash kernels: Mosaic on a TPU, the
      ``xla`` backend elsewhere, at any length / the dense float32 oracle, S x S scores per head);
    * ``"ring"`` / ``"allgather"``: the sequence over ``ring_axis`` (``ring_size`` devices);
    * ``"ulysses"``: over ``ulysses_axis`` (``ulysses_size`` devices, which must split the heads);
    * ``"usp"``: Ulysses over ``ulysses_axis`` inside, the ring over ``ring_axis`` across; local shard
      ``r * ulysses_size + u``.

    An axis the strategy uses defaults to the trainer's name (its first role ``"context"``, USP's
    all-to-all ``"ulysses"``); an axis it does not use is None and its size 1. The sequence is
    permuted by ``layout`` over ``layout_shards`` before it is sharded.
    """

    strategy: Strategy = "splash"
    ring_axis: str | None = None
    ring_size: int = 1
    ulysses_axis: str | None = None
    ulysses_size: int = 1
    layout: layouts.Layout = "zigzag"

    def __post_init__(self):
        plain_fields(self)  # NumPy / JAX scalars as Python numbers
        check_choice("ContextParallel.strategy", self.strategy, STRATEGIES)
        check_choice("ContextParallel.layout", self.layout, layouts.LAYOUTS)
        roles = self.roles
        for role in ("ring", "ulysses"):
            size = check_positive_int(f"ContextParallel.{role}_size", self.size(role))
            if role not in roles:
                if size != 1:
                    users = RING_AXIS_STRATEGIES if role == "ring" else ULYSSES_AXIS_STRATEGIES
                    raise ValueError(f"ContextParallel.{role}_size={size} needs strategy in {users} (which shard the "
                                     f"sequence over {role}_axis), got strategy={self.strategy!r}: set one of them "
                                     f"or {role}_size=1")
                object.__setattr__(self, f"{role}_axis", None)  # unused: no axis (equal values compare equal)
            elif self.axis(role) is None:
                object.__setattr__(self, f"{role}_axis", (CONTEXT, ULYSSES)[roles.index(role)])
            else:
                check_name(f"ContextParallel.{role}_axis", self.axis(role))
        if self.strategy == "usp" and self.ring_axis == self.ulysses_axis:
            raise ValueError(f"strategy='usp' needs two different mesh axes: ring_axis and ulysses_axis are both "
                             f"{self.ring_axis!r} (e.g. ring_axis='context', ulysses_axis='ulysses')")

    # ------------------------------------------------------------------ changes of strategy

    def single_device(self, strategy: Strategy | None = None) -> "ContextParallel":
        """The same model on one device: ``strategy`` (None: this one if it is a single-device
        strategy, else ``"splash"``), no mesh axes."""
        if strategy is None:
            strategy = self.strategy if self.rule.single_device else "splash"
        if strategy not in SINGLE_DEVICE_STRATEGIES:
            raise ValueError(f"single_device(strategy={strategy!r}): expected one of {SINGLE_DEVICE_STRATEGIES}")
        return ContextParallel(strategy, layout=self.layout)

    def on_axis(self, axis: str | None, size: int, strategy: Strategy = "allgather", *,
                layout: layouts.Layout | None = None) -> "ContextParallel":
        """A one-axis strategy (``"ring"``, ``"allgather"`` or ``"ulysses"``) over the mesh axis ``axis``
        (None: the default, ``"context"``) of ``size`` devices; ``layout`` None keeps this one's."""
        if len(RULES.get(strategy, StrategyRule(())).roles) != 1:
            one_axis = tuple(s for s, r in RULES.items() if len(r.roles) == 1)
            raise ValueError(f"on_axis(strategy={strategy!r}): expected a one-axis strategy {one_axis} "
                             f"(USP: ContextParallel('usp', ring_axis=..., ring_size=..., ulysses_axis=..., ...))")
        role = RULES[strategy].roles[0]
        return ContextParallel(strategy, layout=self.layout if layout is None else layout,
                               **{f"{role}_axis": axis, f"{role}_size": size})

    def with_axes(self, *names: str) -> "ContextParallel":
        """The same parallelism on other mesh axes: the used roles, ring first, take ``names``."""
        return dataclasses.replace(self, **{f"{role}_axis": name for role, name in zip(self.roles, names)})

    def replace(self, **changes) -> "ContextParallel":
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ axes

    @property
    def rule(self) -> StrategyRule:
        return RULES[self.strategy]

    @property
    def roles(self) -> tuple[Role, ...]:
        """The axis roles the strategy uses, ring first (USP's local shards are ring-major):
        ``("ring",)``, ``("ulysses",)``, ``("ring", "ulysses")`` for USP, ``()`` on one device."""
        return self.rule.roles

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
        return self.ulysses_size if self.roles == ("ulysses",) else self.ring_size

    def batch_spec(self, data_axis: str | None) -> P:
        """``PartitionSpec`` of a ``[batch, seq]`` array: rows over ``data_axis``, the sequence over
        the strategy's axes (USP: ring-major ``(ring, ulysses)``)."""
        axes = tuple(self.axes())
        return P(data_axis, None if not axes else axes[0] if len(axes) == 1 else axes)

    # ------------------------------------------------------------------ rules

    def check_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """Raise unless the Ulysses degree splits the heads (each device takes ``num_heads / ulysses_size``)."""
        if "ulysses" not in self.roles:
            return
        h, kv, u = num_heads, num_kv_heads, self.ulysses_size
        ok = valid_ulysses_degrees(h, kv)
        if u in ok:
            return
        why = (f"num_heads={h} is not divisible by ulysses_size={u}" if h % u else
               f"num_kv_heads={kv} neither divides nor is divisible by ulysses_size={u}")
        alt = ""
        if self.strategy == "usp":
            n = u * self.ring_size
            alt = f"; (ulysses_size, ring_size) factorisations of the {n} devices that work: " \
                  f"{usp_factorisations(n, h, kv)}"
        raise ValueError(f"strategy={self.strategy!r}: {why} (Ulysses gives each device num_heads / ulysses_size "
                         f"q heads): use ContextParallel.ulysses_size in {ok}{alt}")

    def check_seq_len(self, seq_len: int, splash: SplashConfig, *, name: str = "seq_len") -> None:
        """Raise unless the strategy runs at a global length of ``seq_len`` tokens as it is: the
        ``layout`` splits it over the devices and the Splash blocks of ``splash`` tile what each
        kernel sees (``splash/blocks.py``; the ring and USP shrink blocks to their shards).
        ``"splash"`` pads a length its 128-token lanes do not tile itself (``model.attention``);
        ``"reference"`` runs at any length; ``name``: the length's name in errors."""
        # a length is a positive int (NumPy / JAX integers too): 0, -5 and 512.0 passed for "splash" / "reference"
        a, seq = self.strategy, check_positive_int(name, as_scalar(seq_len))
        if self.rule.ring_schedule:  # the ring shrinks blocks to its shards, or says which config fits
            if seq % self.shards:
                raise ValueError(f"{name}={seq} must be divisible by ring_size x ulysses_size = {self.ring_size} x "
                                 f"{self.ulysses_size} = {self.shards} (one shard per device)")
            fit_ring_blocks(seq, self.ring_size, self.layout, splash)
            return
        if a == "reference":
            return
        if self.roles:
            layouts.check_layout(self.layout, seq, self.layout_shards)
        else:  # the model pads a length the kernels' 128-token lanes do not tile (model.attention)
            seq = -(-seq // NUM_LANES) * NUM_LANES
        q_len = seq // self.ring_size  # all-gather: local queries (ring_size 1 otherwise)
        multiple = math.lcm(self.ring_size * NUM_LANES, self.ulysses_size)
        fit_blocks(splash, q=Extent(q_len, q_len, name if q_len == seq else "per-device q_len"),
                   kv=Extent(seq, seq, name), what=f"strategy={a!r} at {name}={seq}",
                   length_hint=f"a {name} divisible by {multiple}")

    def pad_step(self) -> int:
        """Lengths the layout splits are multiples of this (the search step of ``padded_seq_len``)."""
        return math.lcm(self.shards, self.layout_shards * (2 if self.layout == "zigzag" else 1))
