"""The trainer's mesh: axes ``("data", "context")``, plus ``"ulysses"`` for USP. A model's
context-parallel axes (``TransformerConfig.context_parallel``) map onto it ring-major: the
first onto ``"context"``, USP's all-to-all onto ``"ulysses"``."""

import jax
from jax.sharding import PartitionSpec as P

from ringsplash._scalar_checks import check_positive_int
from ringsplash.model import ContextParallel, TransformerConfig

DATA, CONTEXT = "data", "context"
ULYSSES = "ulysses"  # USP's inner (all-to-all) axis, present only when make_mesh(..., ulysses=a) asks for it


def make_mesh(data: int = 1, context: int = 1, devices=None, *, ulysses: int | None = None) -> jax.sharding.Mesh:
    """A ``(data, context)`` mesh over the first ``data * context`` devices; with ``ulysses``, a
    ``(data, context, ulysses)`` mesh over ``data * context * ulysses`` (for ``attention="usp"``:
    the ring over ``context``, the all-to-all over the innermost ``ulysses``)."""
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


def _on_trainer_axes(model_config: TransformerConfig) -> ContextParallel:
    """The model's context parallelism on the trainer's axes (ring-major: ``context``, ``ulysses``)."""
    return model_config.context_parallel.with_axes(CONTEXT, ULYSSES)


def mesh_for(model_config: TransformerConfig, data: int = 1, devices=None) -> jax.sharding.Mesh:
    """The trainer's mesh for ``model_config``'s strategy: ``(data, context)`` with ``context`` the
    ring / all-gather / Ulysses degree (1 for reference and splash), or ``(data, context, ulysses)``
    for USP (``ring_size`` x ``ulysses_size``)."""
    axes = _on_trainer_axes(model_config).axes()
    return make_mesh(data, axes.get(CONTEXT, 1), devices, ulysses=axes.get(ULYSSES))


def check_mesh(model_config: TransformerConfig, mesh: jax.sharding.Mesh) -> None:
    """The model's context-parallel axes must be the trainer mesh's axes, with the same sizes."""
    cp, shape = model_config.context_parallel, dict(mesh.shape)
    trainer = _on_trainer_axes(model_config)
    for role in cp.roles:
        axis, size = trainer.axis(role), cp.size(role)
        if cp.axis(role) != axis:
            raise ValueError(f"the trainer runs attention={cp.strategy!r} over {axis!r}: set {role}_axis_name={axis!r}")
        if axis not in shape:
            raise ValueError(
                f"attention={cp.strategy!r} needs a {axis!r} mesh axis of {role}_size={size} "
                f"devices; the mesh has {shape}: build it with train.make_mesh(data, context, ulysses=...)"
            )
    for role in cp.roles:
        axis, size = trainer.axis(role), cp.size(role)
        if size != shape[axis]:
            raise ValueError(f"{role}_size={size} must equal the mesh's {axis} axis ({shape[axis]})")
    used = trainer.axes()
    for axis, flag in ((CONTEXT, "context_parallel"), (ULYSSES, "ulysses_parallel")):
        if shape.get(axis, 1) != 1 and axis not in used:
            needs = "attention='usp'" if axis == ULYSSES else "attention='ring', 'allgather', 'ulysses' or 'usp'"
            raise ValueError(f"{flag}={shape[axis]} needs {needs} (or {flag}=1)")


def mesh_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    """Every axis of the trainer's mesh: ``("data", "context")`` (plus ``"ulysses"`` for USP)."""
    return tuple(mesh.axis_names)


def batch_spec(model_config: TransformerConfig) -> P:
    """``PartitionSpec`` of a batch field on the trainer's mesh: rows over ``"data"``, the sequence
    over the strategy's axes (USP: ring-major ``("context", "ulysses")``)."""
    return _on_trainer_axes(model_config).batch_spec(DATA)
