"""The trainer's mesh, built from the model's context parallelism (``mesh_for``): axes
``("data", "context")``, plus ``"ulysses"`` for USP. ``"context"`` / ``"ulysses"`` are
``ContextParallel``'s default axis names (a strategy's first axis, USP's all-to-all)."""

import jax
from jax.sharding import PartitionSpec as P

from ringsplash._internal.scalar_checks import check_positive_int
from ringsplash.model import TransformerConfig
from ringsplash.model.parallelism import CONTEXT, ULYSSES

DATA = "data"


def make_mesh(data: int = 1, context: int = 1, devices=None, *, ulysses: int | None = None) -> jax.sharding.Mesh:
    """A ``(data, context)`` mesh over the first ``data * context`` devices; with ``ulysses``, a
    ``(data, context, ulysses)`` mesh over ``data * context * ulysses`` (for the ``"usp"`` strategy:
    the ring over ``context``, the all-to-all over the innermost ``ulysses``). ``mesh_for`` builds
    the one a model config needs."""
    devices = jax.devices() if devices is None else devices
    if ulysses is not None:
        check_positive_int("ulysses", ulysses)
        context_total = context * ulysses
        mesh = make_mesh(data, context_total, devices)  # the same device checks, on data x (context x ulysses)
        return jax.make_mesh((data, context, ulysses), (DATA, CONTEXT, ULYSSES), devices=list(mesh.devices.flat),
                             axis_types=(jax.sharding.AxisType.Auto,) * 3)
    processes = jax.process_count()
    if processes > 1 and (data * context) % processes:
        raise ValueError(
            f"mesh data={data} x context={context} = {data * context} devices cannot be split evenly over "
            f"{processes} processes: use a mesh whose size is a multiple of the process count"
        )
    if processes > 1 and data * context != len(devices):
        raise ValueError(
            f"mesh data={data} x context={context} = {data * context} devices must use all {len(devices)} devices "
            f"of the {processes} processes (each process feeds its own devices' shards)"
        )
    if len(devices) < data * context:
        raise ValueError(
            f"mesh data={data} x context={context} needs {data * context} devices, found {len(devices)} "
            f"(on CPU set jax.config.update('jax_num_cpu_devices', N) before JAX starts)"
        )
    return jax.make_mesh(
        (data, context), (DATA, CONTEXT), devices=devices[: data * context],
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )


def mesh_for(model_config: TransformerConfig, data: int = 1, devices=None) -> jax.sharding.Mesh:
    """The trainer's mesh for ``model_config.context_parallel``: ``(data, context)`` with ``context``
    the ring / all-gather / Ulysses degree (1 for reference and splash), or ``(data, context, ulysses)``
    for USP (``ring_size`` x ``ulysses_size``)."""
    check_mesh(model_config, None)
    axes = model_config.context_parallel.axes()
    return make_mesh(data, axes.get(CONTEXT, 1), devices, ulysses=axes.get(ULYSSES))


def check_mesh(model_config: TransformerConfig, mesh: jax.sharding.Mesh | None) -> None:
    """The model's context-parallel axes must be the trainer's (``ContextParallel``'s default names)
    and, given a ``mesh``, be its axes with the same sizes; its other axes have one device."""
    cp = model_config.context_parallel
    trainer = cp.with_axes(CONTEXT, ULYSSES)
    if cp != trainer:
        raise ValueError(f"the trainer runs context_parallel over the mesh axes {tuple(trainer.axes())}, but "
                         f"{cp!r} names {tuple(cp.axes())}: leave ring_axis / ulysses_axis at their defaults (None)")
    if mesh is None:
        return
    shape = dict(mesh.shape)
    for axis, size in cp.axes().items():
        if axis not in shape:
            raise ValueError(f"strategy={cp.strategy!r} needs a {axis!r} mesh axis of {size} devices; the mesh has "
                             f"{shape}: build it with train.mesh_for(model_config, data)")
        if size != shape[axis]:
            raise ValueError(f"context_parallel's {axis!r} axis has {size} devices but the mesh's has {shape[axis]}: "
                             f"build the mesh with train.mesh_for(model_config, data)")
    for axis in (CONTEXT, ULYSSES):
        if shape.get(axis, 1) != 1 and axis not in cp.axes():
            raise ValueError(f"the mesh's {axis!r} axis has {shape[axis]} devices, but strategy={cp.strategy!r} does "
                             f"not shard over it: build the mesh with train.mesh_for(model_config, data)")


def mesh_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    """Every axis of the trainer's mesh: ``("data", "context")`` (plus ``"ulysses"`` for USP)."""
    return tuple(mesh.axis_names)


def batch_spec(model_config: TransformerConfig) -> P:
    """``PartitionSpec`` of a batch field on the trainer's mesh: rows over ``"data"``, the sequence
    over the strategy's axes (USP: ring-major ``("context", "ulysses")``)."""
    return model_config.context_parallel.batch_spec(DATA)
