"""What the context-parallel strategies share: mesh-axis checks, the global-mask and block
checks, and the ``shard_map`` wrapper behind every ``*_attention_sharded``. The local Splash
call is ``splash.attention.splash_info_attention``.
"""

import dataclasses
import os

import jax
from jax.sharding import PartitionSpec as P

from ringsplash._internal.checks import check_attention_call
from ringsplash._internal.types import Outputs
from ringsplash.masks.segment_ids import SegmentIds
from ringsplash.splash.blocks import Blocks, Extent, fit_blocks
from ringsplash.splash.config import GENERIC_INTERPRETER, SplashConfig

# ----------------------------------------------------------------------------------------
# mesh axes


def check_mesh_axis(mesh: jax.sharding.Mesh, arg: str, axis_name) -> int:
    """Size of ``axis_name`` in ``mesh``; the error names the argument and the mesh's axes."""
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"mesh has axes {dict(mesh.shape)}, no {arg}={axis_name!r}; pass one of {tuple(mesh.axis_names)} "
            f"or build the mesh with that axis"
        )
    return int(mesh.shape[axis_name])


# ----------------------------------------------------------------------------------------
# input checks shared by the in-shard_map functions


def check_local_inputs(q, k, v, mask, segment_ids, sinks, config, *, shards: int, what: str, scale=None,
                       logit_soft_cap=None, return_max_logits=False):
    """Validate local shards (``S = shards * local_len``) against the global ``(S, S)`` mask through
    the one validation path (``_checks.check_attention_call``); returns
    ``(heads, kv_heads, local_len, head_dim, segment_ids)`` with the ids normalised to int32."""
    shard_len = q.shape[1] if getattr(q, "ndim", None) == 3 else 0
    call = check_attention_call(
        q, k, v, mask=mask, mask_required=True, mask_shape=(shard_len * shards,) * 2,
        mask_hint=f"the global (S, S): local length {shard_len} x {shards} shards, {what}",
        segment_ids=segment_ids, segment_hint=f"segment ids are per shard: local length = {shard_len}",
        scale=scale, logit_soft_cap=logit_soft_cap, sinks=sinks, config=config, config_type=SplashConfig,
        equal_lengths=True, return_max_logits=return_max_logits,
    )
    return call.heads, call.kv_heads, call.q_len, call.head_dim, call.segment_ids


def fit_gathered_blocks(config: SplashConfig, *, q_len: int, kv_len: int, seq_multiple: int, what: str,
                        head_dim: int | None = None, dtype=None, sparse: bool = False) -> Blocks:
    """The blocks all-gather and Ulysses run with: the rule of every path (``splash/blocks.py``),
    for kernels that see whole arrays of ``q_len`` queries and ``kv_len`` keys; an S divisible
    by ``seq_multiple`` always fits. ``head_dim``, ``dtype`` and ``sparse`` pick the tuned rows
    as for ``splash_attention`` (``splash.blocks.is_sparse``)."""
    return fit_blocks(config, q=Extent(q_len, q_len, "q_len" if q_len == kv_len else "per-device q_len"),
                      kv=Extent(kv_len, kv_len, "kv_len"), what=what,
                      length_hint=f"use S divisible by {seq_multiple}", head_dim=head_dim, dtype=dtype, sparse=sparse)


def cpu_client_threads() -> int:
    """Threads of the XLA:CPU client's pool in this process: ``NPROC`` if set, else the CPUs this
    process may run on, and at least one per local CPU device (XLA's own sizing rule)."""
    nproc = os.environ.get("NPROC", "")
    threads = int(nproc) if nproc.strip().isdigit() else len(os.sched_getaffinity(0))
    return max(threads, len(jax.local_devices(backend="cpu")))


def interpreter_for_mesh(config: SplashConfig, what: str) -> SplashConfig:
    """The ``"interpret"`` backend inside a strategy's ``shard_map``: ``interpret_params=None``
    becomes the generic interpreter (no barrier, any number of devices, same numerics); an
    explicit TPU interpreter is refused where it would deadlock. Other backends pass through.

    Why it deadlocks: every interpreted kernel waits on a barrier of all devices, so each simulated
    device's program holds one thread of the XLA:CPU client's pool while it waits; the kernel body
    runs in callbacks (``io_callback``), which first copy their operands to CPU device 0, and that copy needs
    a free thread of the same pool. With every thread held by a device in the barrier, the copy
    never runs (measured on a 2-core host: 4 of 4 simulated devices hang, 4 of 5 run; ``NPROC=4``
    hangs 4 devices, ``NPROC=5`` runs them). So the TPU interpreter needs more pool threads than
    the mesh has devices in this process."""
    if config.backend != "interpret":
        return config
    if config.interpret_params is None:
        return dataclasses.replace(config, interpret_params=GENERIC_INTERPRETER)
    if config.interpret_params == GENERIC_INTERPRETER:
        return config
    # the mesh's devices in this process: all of it, or all local devices where it spans processes
    local = min(jax.sharding.get_abstract_mesh().size, len(jax.local_devices(backend="cpu")))
    threads = cpu_client_threads()
    if local > 1 and local >= threads:
        raise ValueError(
            f"{what}: config.interpret_params={config.interpret_params!r} runs the Pallas TPU interpreter, "
            f"which deadlocks when the mesh's {local} devices in this process hold all {threads} threads of the "
            f"XLA:CPU client (each waits in the interpreter's barrier; its callbacks need one more thread); "
            f"pass interpret_params={GENERIC_INTERPRETER!r} (or None) for the generic interpreter, or give the "
            f"client more threads than the mesh has devices: NPROC={local + 1} or "
            f"jax_num_cpu_devices > {local}, set before JAX initialises"
        )
    return config


# ----------------------------------------------------------------------------------------
# the shard_map wrapper of every *_attention_sharded


def check_global_inputs(q, k, v, mask, segment_ids, sinks, what: str, *, config=None, scale=None,
                        logit_soft_cap=None, return_max_logits=False) -> tuple[int, int, int, int, SegmentIds | None]:
    """Validate global arrays through the one validation path; returns
    ``(heads, kv_heads, seq_len, head_dim, segment_ids)`` with the ids normalised to int32 (so
    concrete 64-bit ids are compared exactly before they are sharded)."""
    call = check_attention_call(
        q, k, v, mask=mask, mask_required=True, segment_ids=segment_ids, scale=scale,
        logit_soft_cap=logit_soft_cap, sinks=sinks, config=config, config_type=SplashConfig,
        equal_lengths=True, return_max_logits=return_max_logits,
    )
    del what  # the messages of check_attention_call name the argument already
    return call.heads, call.kv_heads, call.q_len, call.head_dim, call.segment_ids


def run_sharded(local, mesh, seq_axes, q, k, v, segment_ids, sinks, *, want: Outputs):
    """``shard_map(local)(q, k, v, segment_ids, sinks)``, the sequence sharded over ``seq_axes``
    (one mesh axis, or a tuple: major to minor), sinks replicated; ``local`` returns ``out``, or an
    ``AttentionOutput`` with ``want.max_logits``; the result is packaged by ``want`` (``out`` like
    ``q``, max logits replicated)."""
    max_logits = want.max_logits
    if max_logits:  # shard_map's out specs take (out, max_logits)
        local = lambda *a, local=local: (lambda r: (r.out, r.max_logits))(local(*a))
    seq = P(None, seq_axes)
    seg_spec = None if segment_ids is None else SegmentIds(P(seq_axes), P(seq_axes))
    in_specs = (seq, seq, seq, seg_spec, None if sinks is None else P())
    args = (q, k, v, segment_ids, sinks)
    explicit = jax.sharding.AxisType.Explicit
    if any(t == explicit for t in getattr(mesh, "axis_types", ())):  # explicit meshes do not reshard implicitly
        args = jax.tree.map(lambda x, s: jax.reshard(x, jax.NamedSharding(mesh, s)), args, in_specs)
    # check_vma=False as in the ring: inside a custom_vjp backward the residuals' varying-axis
    # types are not visible (jax 0.10.2), so replicated sinks' cotangents cannot be typed.
    out_specs = (seq, P()) if max_logits else seq
    result = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
    return want.package(result[0], max_logits=result[1]) if max_logits else result


__all__ = [
    "check_global_inputs",
    "check_local_inputs",
    "check_mesh_axis",
    "fit_gathered_blocks",
    "interpreter_for_mesh",
    "run_sharded",
]
