"""The records every Splash backend takes: one shard pair's traced operands and the static
(hashable, host-side) settings that pick and shape the computation.

Both backends (``splash/pallas.py``, the Pallas kernels, and ``splash/xla.py``, jnp) implement::

    forward(inputs: ForwardInputs, static: BackendStatic, *, out_dtype=None) -> (out, lse)
    backward(inputs: BackwardInputs, static: BackendStatic) -> (dq, dk, dv)   # float32

``out`` is ``[heads, q_len, dv]`` (v's head size, which may differ from q's) in ``out_dtype``
(None = q's dtype), ``lse`` float32 ``[heads, q_len]`` (sink-free). The input records are
pytrees whose leaves are all traced (absent segment ids / transposed schedule are None, an
empty subtree), so a dispatcher can pass them through ``jax.lax.platform_dependent`` whole;
everything static lives in ``BackendStatic``.
"""

import dataclasses
from typing import NamedTuple

from ringsplash._internal.types import Array, Float, Int
from ringsplash.blocksparse.mask_info import BlockSchedule, MaskInfo
from ringsplash.splash.config import SplashConfig


class ForwardInputs(NamedTuple):
    """Traced operands of one shard pair's forward."""

    q: Float[Array, "heads q_len d"]
    k: Float[Array, "kv_heads kv_len d"]
    v: Float[Array, "kv_heads kv_len dv"]
    schedule: BlockSchedule  # the pair's work lists (``info.schedule(q_shard, kv_shard)``)
    q_pos: Int[Array, " q_len"]  # original positions of the local rows
    kv_pos: Int[Array, " kv_len"]  # ... and columns
    q_seg: Int[Array, " q_len"] | None  # segment ids, int32, or None
    kv_seg: Int[Array, " kv_len"] | None


class BackwardInputs(NamedTuple):
    """Traced operands of one shard pair's backward: the forward's plus the cotangent, the
    *final* lse (sinks included) and ``delta = rowsum(d_out * out)`` of the final output."""

    q: Float[Array, "heads q_len d"]
    k: Float[Array, "kv_heads kv_len d"]
    v: Float[Array, "kv_heads kv_len dv"]
    d_out: Float[Array, "heads q_len dv"]
    lse: Float[Array, "heads q_len"]
    delta: Float[Array, "heads q_len"]
    schedule: BlockSchedule
    schedule_dkv: BlockSchedule | None  # of ``BackendStatic.info_dkv`` (None for xla)
    q_pos: Int[Array, " q_len"]
    kv_pos: Int[Array, " kv_len"]
    q_seg: Int[Array, " q_len"] | None
    kv_seg: Int[Array, " kv_len"] | None


@dataclasses.dataclass(frozen=True)
class BackendStatic:
    """Static settings of one call (hashable: a ``custom_vjp`` non-differentiable argument).

    ``info`` is the forward MaskInfo, ``info_dkv`` the transposed one with
    ``config.block_shape_dkv`` (None where only the xla backend runs); ``scale`` is resolved
    (never None); ``logit_soft_cap`` positive or None.
    """

    info: MaskInfo
    info_dkv: MaskInfo | None
    scale: float
    logit_soft_cap: float | None
    config: SplashConfig
