"""Lowering-time guards: identity primitives whose lowering rules check what only the lowering
platform knows.

* ``mosaic_tpu_guard``: ``SplashConfig(backend="mosaic_tpu")`` lowered for anything but TPU
  raises a ValueError naming the backend (instead of Mosaic's own error deep inside the kernel).
* ``vmem_guard``: lowered for TPU, it checks a kernel call's scoped VMEM (``splash/vmem.py``)
  against the chip being compiled for. The chip is known only then (an
  ahead-of-time compile from a CPU host traces without it); an unknown chip lowers unchanged.

An eager call compiles each primitive for the default device (jit), so it hits the lowering
rules too.
"""

import functools

import jax
import jax.extend.core as jex_core
import numpy as np
from jax.interpreters import batching, mlir

from ringsplash.splash.vmem import KernelVmem

__all__ = ["mosaic_tpu_guard", "vmem_guard"]

# ----------------------------------------------------------------------------------------
# "mosaic_tpu": the identity on TPU, a clear error when lowered for anything else

_mosaic_guard_p = jex_core.Primitive("splash_mosaic_tpu_guard")
_mosaic_guard_p.def_impl(lambda x: jax.jit(_mosaic_guard_p.bind)(x))
_mosaic_guard_p.def_abstract_eval(lambda x: x)
batching.primitive_batchers[_mosaic_guard_p] = lambda args, dims: (_mosaic_guard_p.bind(*args), dims[0])


def mosaic_tpu_guard(x):
    """``x``, unchanged on TPU; lowering it for any other platform raises a ValueError that
    names ``backend='mosaic_tpu'`` (instead of Mosaic's own error deep inside the kernel)."""
    return _mosaic_guard_p.bind(x)


def _guard_error(ctx, x):
    platforms = getattr(ctx.module_context, "platforms", None)
    raise ValueError(
        f"SplashConfig(backend='mosaic_tpu') compiles Pallas TPU kernels, but this computation is "
        f"being lowered for {platforms}; use backend='auto' (TPU kernels on TPU, the jnp "
        f"implementation elsewhere) or backend='interpret' (the TPU kernels interpreted on CPU)"
    )


mlir.register_lowering(_mosaic_guard_p, _guard_error)
mlir.register_lowering(_mosaic_guard_p, lambda ctx, x: [x], platform="tpu")

# ----------------------------------------------------------------------------------------
# scoped VMEM: the identity; its TPU lowering runs the check with the chip being compiled for

_vmem_guard_p = jex_core.Primitive("splash_vmem_guard")
_vmem_guard_p.def_impl(lambda x, *, need: jax.jit(functools.partial(_vmem_guard_p.bind, need=need))(x))
_vmem_guard_p.def_abstract_eval(lambda x, *, need: x)
batching.primitive_batchers[_vmem_guard_p] = lambda args, dims, *, need: (_vmem_guard_p.bind(*args, need=need),
                                                                        dims[0])


def vmem_guard(x, need: KernelVmem):
    """``x``, unchanged; lowering it for TPU raises when ``need`` exceeds the chip's VMEM limit."""
    return _vmem_guard_p.bind(x, need=need)


def _chip(ctx) -> str | None:
    """The ``device_kind`` the module is lowered for: from its mesh (shard_map), its device
    assignment (jit over several devices) or the compiling client's devices (one device, also
    a compile-only topology client); None when unknown or mixed."""
    module = ctx.module_context
    axis_context = module.axis_context
    devices = getattr(axis_context, "device_assignment", None)
    if devices is None and getattr(axis_context, "mesh", None) is not None:
        devices = np.asarray(axis_context.mesh.devices).flat
    if devices is None and module.backend is not None:
        devices = module.backend.devices()
    kinds = {getattr(d, "device_kind", None) for d in devices or ()}
    return kinds.pop() if len(kinds) == 1 else None


def _lower_tpu(ctx, x, *, need):
    need.check(_chip(ctx))
    return [x]


mlir.register_lowering(_vmem_guard_p, lambda ctx, x, *, need: [x])
mlir.register_lowering(_vmem_guard_p, _lower_tpu, platform="tpu")
