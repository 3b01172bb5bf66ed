"""Ahead-of-time compiles for real TPU targets from a CPU host: topology meshes, chip facts,
compile reports.

With the ``tpu`` extra (libtpu) and ``JAX_PLATFORMS=cpu``, ``jax.experimental.topologies``
describes a TPU slice whose devices can be put in a mesh and compiled for, but not run on.
That proves a program lowers for the chip (Pallas kernels through Mosaic) and gives its
per-device memory (``compiled.memory_analysis()``) and scheduled HLO (``compiled.as_text()``).

    mesh = aot.topology_mesh("v5e:2x2", ("context",))
    q = aot.abstract((8, 32768, 128), jnp.bfloat16, mesh, P(None, "context"))
    report = aot.compile_report(fwd_bwd, q, q, q, q)
    report.fits, report.total / aot.GiB, "collective-permute-start" in report.hlo_text

Chip facts live in one table (:data:`CHIPS`): HBM per JAX device, and SMEM / VMEM per
TensorCore from Pallas' hardware table (``pltpu.get_tpu_info_for_chip``).
"""

import functools
import time
from typing import NamedTuple

import jax
import numpy as np

__all__ = [
    "CHIPS",
    "AotReport",
    "ChipInfo",
    "GiB",
    "MiB",
    "abstract",
    "chip",
    "compile_report",
    "find_chip",
    "topology_devices",
    "topology_mesh",
]

GiB = 1 << 30
MiB = 1 << 20


class _Row(NamedTuple):
    pltpu_version: str  # ``pltpu.ChipVersion`` value
    hbm_bytes: int  # per JAX device
    scoped_vmem_bytes: int | None  # Mosaic's default scoped VMEM limit (from its out-of-memory error)
    device_kinds: tuple[str, ...]  # ``jax.Device.device_kind`` spellings


#: chip generation (as a topology name starts: ``"v5e:2x2"``) -> its facts. HBM is per JAX
#: device: one device per chip, except tpu7x (Ironwood), whose 192 GiB per chip are shared by
#: its 2 TensorCores, each a JAX device (``v5p`` / ``v4`` megacore is one device). The scoped
#: VMEM limits were read from Mosaic's out-of-memory error compiling for each target with libtpu
#: ("... limit 16.00M"); None where not measured.
CHIPS = {
    "v4": _Row("v4", 32 * GiB, None, ("TPU v4",)),
    "v4i": _Row("v4i", 8 * GiB, None, ("TPU v4 lite",)),
    "v5e": _Row("v5e", 16 * GiB, 16 * MiB, ("TPU v5e", "TPU v5 lite")),
    "v5p": _Row("v5p", 95 * GiB, None, ("TPU v5", "TPU v5p")),
    "v6e": _Row("v6e", 32 * GiB, 32 * MiB, ("TPU v6e", "TPU v6 lite")),
    "tpu7x": _Row("7x", 96 * GiB, None, ("TPU7x",)),
}
_BY_KIND = {kind: name for name, row in CHIPS.items() for kind in row.device_kinds}


class ChipInfo(NamedTuple):
    name: str  # generation, as a topology name starts ("v5e")
    hbm_bytes: int  # per JAX device
    smem_bytes: int  # per TensorCore
    vmem_bytes: int  # per TensorCore (capacity)
    scoped_vmem_bytes: int | None  # Mosaic's default scoped VMEM limit; None = not measured


@functools.cache
def _info(name: str) -> ChipInfo:
    from jax.experimental.pallas import tpu as pltpu

    row = CHIPS[name]
    tpu = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(row.pltpu_version), 1)
    return ChipInfo(name, row.hbm_bytes, tpu.smem_capacity_bytes, tpu.vmem_capacity_bytes, row.scoped_vmem_bytes)


def find_chip(device_kind_or_topology: str | None) -> ChipInfo | None:
    """:func:`chip`, or None for anything that names no known TPU (a CPU device kind, None)."""
    key = device_kind_or_topology or ""
    name = _BY_KIND.get(key) or (key.split(":")[0] if key.split(":")[0] in CHIPS else None)
    return None if name is None else _info(name)


def chip(device_kind_or_topology: str) -> ChipInfo:
    """Facts of a TPU chip named by a ``jax.Device.device_kind`` (``"TPU v5 lite"``), a topology
    (``"v5e:2x2"``) or a generation (``"v5e"``)."""
    info = find_chip(device_kind_or_topology)
    if info is None:
        raise ValueError(f"device_kind_or_topology={device_kind_or_topology!r} names no known TPU chip: expected a "
                         f"device kind ({', '.join(sorted(_BY_KIND))}) or a topology of {sorted(CHIPS)}")
    return info


# ----------------------------------------------------------------------------------------
# topologies and abstract arguments


@functools.cache
def topology_devices(name: str) -> np.ndarray:
    """The devices of TPU topology ``name`` (``"v5e:2x2"``, ``"v5p:2x2x1"``, ``"v5e:1x1"``: one chip),
    flat, in libtpu's order."""
    from jax.experimental import topologies

    if not isinstance(name, str) or find_chip(name) is None or ":" not in name:
        raise ValueError(f"topology name={name!r}: expected '<chip>:<shape>' with a chip of {sorted(CHIPS)}, "
                         "e.g. 'v5e:2x2' or 'v5p:2x2x1'")
    dims = [int(x) for x in name.split(":", 1)[1].split("x") if x.isdigit()]
    # a slice smaller than libtpu's default host (2x2x1 chips), e.g. "v5e:1x1" (one chip): its own host bounds
    small = {"chips_per_host_bounds": tuple(dims + [1] * (3 - len(dims)))} if dims and np.prod(dims) < 4 else {}
    try:
        topo = topologies.get_topology_desc(name, "tpu", **small)
    except Exception as e:  # libtpu missing, or a shape it does not know
        raise ValueError(f"topology name={name!r}: libtpu could not describe it ({type(e).__name__}: "
                         f"{str(e).strip()[:300]}); needs the 'tpu' extra and JAX_PLATFORMS=cpu") from e
    return np.asarray(topo.devices).reshape(-1)


def topology_mesh(name: str, axis_names, shape=None) -> jax.sharding.Mesh:
    """A mesh over all devices of topology ``name``; ``shape`` defaults to one axis of them all."""
    axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    devices = topology_devices(name)
    if shape is None:
        if len(axis_names) != 1:
            raise ValueError(f"shape is needed for {len(axis_names)} axes {axis_names}")
        shape = (devices.size,)
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(axis_names) or int(np.prod(shape)) != devices.size:
        raise ValueError(f"{shape=} over {axis_names=} must multiply to the {devices.size} devices of {name!r}")
    return jax.sharding.Mesh(devices.reshape(shape), axis_names)


def abstract(shape, dtype, mesh: jax.sharding.Mesh, spec=None) -> jax.ShapeDtypeStruct:
    """A ``ShapeDtypeStruct`` laid out as ``spec`` (default: replicated) over ``mesh``."""
    spec = jax.sharding.PartitionSpec() if spec is None else spec
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=jax.sharding.NamedSharding(mesh, spec))


# ----------------------------------------------------------------------------------------
# compile report


class AotReport(NamedTuple):
    """Per-device bytes of a compiled program (``compiled.memory_analysis()``)."""

    temp: int
    args: int
    out: int
    code: int
    alias: int  # output bytes aliased to donated arguments
    total: int  # args + out - alias + temp + code
    hbm: int | None  # HBM per device of the chip compiled for; None = not a known TPU
    fits: bool | None  # total <= hbm
    hlo_text: str  # compiled, scheduled HLO
    seconds: float  # lower + compile

    def fits_within(self, fraction: float) -> bool | None:
        """``total <= fraction x hbm`` (None when the chip is unknown)."""
        return None if self.hbm is None else self.total <= fraction * self.hbm


def _device_kind(compiled) -> str | None:
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    kinds = {d.device_kind for s in shardings for d in s.device_set}
    return kinds.pop() if len(kinds) == 1 else None


def compile_report(fn, *abstract_args, **jit_kwargs) -> AotReport:
    """Lower and compile ``jax.jit(fn, **jit_kwargs)`` (or ``fn`` itself when it is already
    jitted and no keyword is given) for ``abstract_args`` and report its memory and HLO.
    Compiler errors (e.g. out of HBM or VMEM) propagate."""
    t0 = time.perf_counter()
    jitted = fn if hasattr(fn, "lower") and not jit_kwargs else jax.jit(fn, **jit_kwargs)
    compiled = jitted.lower(*abstract_args).compile()
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    temp, args, out = mem.temp_size_in_bytes, mem.argument_size_in_bytes, mem.output_size_in_bytes
    alias, code = mem.alias_size_in_bytes, getattr(mem, "generated_code_size_in_bytes", 0)
    total = args + out - alias + temp + code
    info = find_chip(_device_kind(compiled))
    hbm = None if info is None else info.hbm_bytes
    return AotReport(temp, args, out, code, alias, total, hbm, None if hbm is None else total <= hbm,
                     compiled.as_text(), seconds)


def trace_chip() -> str | None:
    """The ``device_kind`` of JAX's default device when it is a TPU, else None; also None before
    JAX has started its backends: blocks are fitted when a config is checked too, and starting
    JAX there would fix the device count before a script sets it (a later trace sees the chip)."""
    import jax
    from jax._src import xla_bridge  # no public way to ask without starting the backends

    if not getattr(xla_bridge, "backends_are_initialized", lambda: True)():
        return None
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return None
    return device.device_kind if device.platform == "tpu" else None
