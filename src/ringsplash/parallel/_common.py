"""What the context-parallel strategies share: mesh-axis checks, the global-mask and block
checks, and the ``shard_map`` wrapper behind every ``*_attention_sharded``. The local Splash
call is ``splash.attention.splash_info_attention``.
"""

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from ringsplash._checks import check_attention_call
from ringsplash.segment_ids import SegmentIds
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


def fit_gathered_blocks(config: SplashConfig, *, q_len: int, kv_len: int, seq_multiple: int, what: str) -> Blocks:
    """The blocks all-gather and Ulysses run with: the rule of every path (``splash/blocks.py``),
    for kernels that see whole arrays of ``q_len`` queries and ``kv_len`` keys; an S divisible
    by ``seq_multiple`` always fits."""
    return fit_blocks(config, q=Extent(q_len, q_len, "q_len" if q_len == kv_len else "per-device q_len"),
                      kv=Extent(kv_len, kv_len, "kv_len"), what=what,
                      length_hint=f"use S divisible by {seq_multiple}")


#: Devices from which the Pallas TPU interpreter deadlocks inside a multi-device program on
#: the CPU client: it waits on a barrier of every simulated device at each kernel, while its
#: io_callbacks copy their operands to CPU device 0 and wait for the copy, which queues behind
#: the device programs parked in that barrier (reproduced at 8 devices on this 2-core host).
TPU_INTERPRETER_DEVICE_LIMIT = 8


def interpreter_for_mesh(config: SplashConfig, what: str) -> SplashConfig:
    """The ``"interpret"`` backend inside a strategy's ``shard_map``: ``interpret_params=None``
    becomes the generic interpreter (no barrier, any number of devices, same numerics); an
    explicit TPU interpreter is refused on a mesh of ``TPU_INTERPRETER_DEVICE_LIMIT`` or more
    devices instead of hanging. Other backends pass through."""
    if config.backend != "interpret":
        return config
    if config.interpret_params is None:
        return dataclasses.replace(config, interpret_params=GENERIC_INTERPRETER)
    devices = jax.sharding.get_abstract_mesh().size
    if config.interpret_params != GENERIC_INTERPRETER and devices >= TPU_INTERPRETER_DEVICE_LIMIT:
        raise ValueError(
            f"{what}: config.interpret_params={config.interpret_params!r} runs the Pallas TPU interpreter, "
            f"which deadlocks on a mesh of {devices} >= {TPU_INTERPRETER_DEVICE_LIMIT} simulated devices; "
            f"pass interpret_params={GENERIC_INTERPRETER!r} (or None) for the generic interpreter, or use "
            f"fewer than {TPU_INTERPRETER_DEVICE_LIMIT} devices"
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


def run_sharded(local, mesh, seq_axes, q, k, v, segment_ids, sinks, *, max_logits=False):
    """``shard_map(local)(q, k, v, segment_ids, sinks)``, the sequence sharded over ``seq_axes``
    (one mesh axis, or a tuple: major to minor), sinks replicated; output like ``q`` (with
    ``max_logits``: ``(out, max_logits)``, the latter replicated)."""
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
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


__all__ = [
    "check_global_inputs",
    "check_local_inputs",
    "check_mesh_axis",
    "fit_gathered_blocks",
    "interpreter_for_mesh",
    "run_sharded",
]
