"""How parameters and optimiser state are laid out over the mesh: replicated, or sharded FSDP /
ZeRO-3 style over several mesh axes together (the trainer uses ``("data", "context")``, so a
pure context-parallel run shards them too).

Rule: each parameter is split along ONE dimension over all the FSDP axes together —
``P(..., ("data", "context"), ...)`` on the largest dimension the number of devices divides,
never a stacked leading axis (a scanned layer step needs one whole layer, so the layer axis
stays whole and each step gathers its own layer). A parameter none of whose dimensions divide
is left replicated and listed in ``ShardingPlan.replicated`` (reported, never an error).

Inside ``shard_map`` the model sees local shards; ``gather`` rebuilds full weights with
``jax.lax.all_gather(..., tiled=True)`` just before use. Differentiating through it gives the
transposed collective, a ``psum_scatter``: the gradient of a sharded parameter arrives already
summed over every device and sharded like the parameter (ZeRO's reduce-scatter). The
optimiser state follows the parameters' shardings (``optimizer_shardings``), so AdamW's
moments are sharded too. XLA schedules the gathers; the scan over layers lets it prefetch the
next layer's weights while the current one computes.

This module knows about arrays, specs and mesh axes only (not about attention or models).
"""

import dataclasses
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Partition specs of a parameter tree, and what could not be sharded.

    Attributes:
        specs: a tree like the parameters with a ``PartitionSpec`` per array leaf.
        axes: the mesh axes the parameters are sharded over (empty: replicated).
        num_shards: number of devices along ``axes`` together.
        replicated: ``"path shape"`` of each parameter left replicated because no dimension
            (other than a stacked leading one) is divisible by ``num_shards``.
    """

    specs: object
    axes: tuple[str, ...]
    num_shards: int
    replicated: tuple[str, ...] = ()

    @property
    def sharded(self) -> bool:
        return bool(self.axes) and self.num_shards > 1


def path_name(path) -> str:
    """``"layers.attention.wq"`` for a ``jax.tree_util`` key path."""
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def fsdp_dim(shape: Sequence[int], num_shards: int, *, skip_leading: int = 0) -> int | None:
    """The dimension of ``shape`` to shard over ``num_shards`` devices: the largest one they
    divide (the first on ties), ignoring the ``skip_leading`` first (stacked) dimensions;
    ``None`` when none divides."""
    best = None
    for d in range(skip_leading, len(shape)):
        if shape[d] % num_shards == 0 and (best is None or shape[d] > shape[best]):
            best = d
    return best


def plan_sharding(
    params,
    mesh_shape: dict[str, int],
    *,
    fsdp: bool,
    axes: tuple[str, ...],
    stacked: Callable[[str], bool] = lambda path: False,
) -> ShardingPlan:
    """Partition specs for ``params`` (arrays or ``jax.ShapeDtypeStruct``; other leaves ignored).

    Args:
        params: the parameter tree (e.g. ``eqx.filter(model, eqx.is_array)``).
        mesh_shape: mesh axis sizes, e.g. ``dict(mesh.shape)``.
        fsdp: shard over ``axes`` (``False``: every parameter replicated, ``P()``).
        axes: mesh axes to shard over together (their sizes multiply).
        stacked: given a leaf's path (``"layers.attention.wq"``), whether its leading axis is a
            stacked layer axis that must stay whole.
    """
    for a in axes:
        if a not in mesh_shape:
            raise ValueError(f"axes={axes} must be mesh axes; the mesh has {tuple(mesh_shape)}")
    num_shards = int(np.prod([mesh_shape[a] for a in axes])) if fsdp else 1
    replicated = []

    def spec(path, x):
        if not fsdp or num_shards == 1:
            return P()
        name = path_name(path)
        skip = 1 if stacked(name) else 0
        d = fsdp_dim(x.shape, num_shards, skip_leading=skip)
        if d is None:
            replicated.append(f"{name} {tuple(x.shape)}")
            return P()
        return P(*([None] * d), axes)

    specs = jax.tree_util.tree_map_with_path(spec, params)
    return ShardingPlan(specs, tuple(axes) if fsdp else (), num_shards, tuple(replicated))


def plan_model_sharding(model, mesh: jax.sharding.Mesh, *, fsdp: bool) -> ShardingPlan:
    """The layout of a ringsplash ``Transformer``'s parameters on ``mesh``, the one plan the trainer
    (``train.sharding_plan``) and ``hf.load_hf`` share: FSDP over every mesh axis together, each
    stacked ``layers.`` leaf's layer axis kept whole; or replicated (``fsdp=False``).

    ``model``: the model, or its abstract twin (``model.abstract_model(config)``); ``specs`` is a tree
    like it with ``None`` where a leaf is not an array."""
    params = eqx.filter(model, lambda x: isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray))
    return plan_sharding(params, dict(mesh.shape), fsdp=fsdp, axes=tuple(mesh.axis_names),
                         stacked=lambda path: path.startswith("layers."))


def _sharded_dim(spec: P) -> int | None:
    for d, entry in enumerate(spec):
        if entry is not None:
            return d
    return None


def unstacked(specs):
    """Specs of one layer of a stacked tree: the leading (layer) axis removed."""
    return jax.tree.map(lambda s: P(*tuple(s)[1:]), specs, is_leaf=lambda s: isinstance(s, P))


def gather(tree, specs, axes: tuple[str, ...], *, dtype=None):
    """Inside ``shard_map``: the full arrays of a tree of local shards (``all_gather`` over
    ``axes`` along each leaf's sharded dimension; replicated leaves pass through).

    Args:
        tree: local shards (a pytree of arrays; ``None`` leaves allowed).
        specs: a matching tree of ``PartitionSpec`` (from ``plan_sharding``).
        axes: the mesh axes the shards are split over.
        dtype: if given, sharded floating leaves of rank >= 2 (matmul weights) are cast to it
            before the gather (half the traffic and memory in bfloat16; the model casts them
            to its compute dtype anyway).
    """
    def one(x, spec):
        d = _sharded_dim(spec)
        if d is None:
            return x
        if dtype is not None and x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(dtype)
        return jax.lax.all_gather(x, axis_name=axes, axis=d, tiled=True)

    return jax.tree.map(one, tree, specs)


def is_sharded(spec: P) -> bool:
    return _sharded_dim(spec) is not None


def shardings(specs, mesh: jax.sharding.Mesh):
    """``NamedSharding`` per leaf of a tree of specs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def optimizer_shardings(optimizer: optax.GradientTransformation, params, param_shardings, mesh):
    """Shardings of ``optimizer.init(params)``: leaves shaped like a parameter (AdamW moments)
    take that parameter's sharding, everything else (step counts) is replicated."""
    state = jax.eval_shape(optimizer.init, params)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(
        optimizer, lambda _, s: s, state, param_shardings,
        transform_non_params=lambda _: replicated,
    )


def local_bytes(tree, specs, mesh_shape: dict[str, int]) -> int:
    """Bytes one device holds of ``tree`` (arrays / ShapeDtypeStructs) under ``specs``."""
    total = 0
    for x, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)), strict=True):
        n = int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
        for entry in spec:
            for a in (entry,) if isinstance(entry, str) else (entry or ()):
                n //= mesh_shape[a]
        total += n
    return total


def describe(plan: ShardingPlan) -> str:
    """One line for reports: how parameters are laid out and which stayed replicated."""
    if not plan.sharded:
        return "parameters and optimiser state replicated"
    line = f"parameters and optimiser state sharded (FSDP) over {' x '.join(plan.axes)} = {plan.num_shards} devices"
    if plan.replicated:
        line += f"; replicated (no dimension divisible by {plan.num_shards}): {', '.join(plan.replicated)}"
    return line


__all__ = [
    "ShardingPlan",
    "describe",
    "fsdp_dim",
    "gather",
    "is_sharded",
    "local_bytes",
    "optimizer_shardings",
    "path_name",
    "plan_model_sharding",
    "plan_sharding",
    "shardings",
    "unstacked",
]
