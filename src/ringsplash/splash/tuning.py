"""Block sizes the default ``SplashConfig`` runs with, per TPU generation, measured on the chip.

A ``SplashConfig`` block left at None is filled here, when blocks are fitted to a call
(``splash/blocks.py``, every path), from the chip JAX computes on at trace time (its default
backend), the length of the kv sequence the kernels see, q's head size and dtype. The rows were
measured with ``scripts/bench_splash_tpu.py`` (``docs/tpu.md`` has the tables): the fastest
blocks of the forward and of forward + backward, causal, 16 heads, bfloat16.

Generations not measured yet take v5e's rows when they have at least 64 MiB of VMEM per core,
else 512-blocks; on every known chip the blocks are then halved until the kernels' scoped VMEM
(``splash/vmem.py``'s estimate; each kernel is compiled with most of the chip's VMEM as its
limit) fits the chip. A host without a TPU (CPU, or an ahead-of-time compile for a TPU target
from a CPU host, where the target is unknown at trace time) takes v5e's rows as they are.
"""

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from ringsplash import aot
from ringsplash.aot import trace_chip
from ringsplash.splash.tpu_tiles import NUM_LANES
from ringsplash.splash.vmem import KernelVmem, usable_vmem_bytes

__all__ = ["TunedBlocks", "trace_chip", "tuned_blocks"]


class TunedBlocks(NamedTuple):
    block_q: int
    block_kv: int
    block_kv_compute: int
    block_q_dkv: int
    block_kv_dkv: int


_SMALL = TunedBlocks(512, 512, 512, 512, 512)

#: generation -> {head sizes up to: [(from kv length, blocks), ...] ascending}. v5e: measured on one
#: v5e chip (TPU v5 lite, jax 0.10.2, libtpu 0.0.42.1), causal, 16 heads, bfloat16, head size 128
#: (docs/tpu.md); larger head sizes (and float32, which counts double) keep 1024-blocks, not measured.
#: The 8K row (measured 2026-12-06, recorded in commit e7fd6ff): kv blocks of 2048 took the causal forward
#: at 16K from 8.51 to 8.15 ms.
_MEASURED = {
    "v5e": {
        128: ((0, _SMALL), (4096, TunedBlocks(1024, 1024, 512, 1024, 1024)),
              (8192, TunedBlocks(1024, 2048, 512, 1024, 1024)),
              (32768, TunedBlocks(2048, 2048, 512, 1024, 2048))),
        1 << 30: ((0, _SMALL), (8192, TunedBlocks(1024, 1024, 512, 1024, 1024))),
    },
}
_LARGE_VMEM = 64 << 20  # generations with at least this much VMEM per core take v5e's rows
#: ``sparse`` calls (segment ids, banded masks: mostly partial tiles) take no row with kv blocks over
#: 1024: on v5e at 32K, 16 packed documents ran 41 ms at 2048-blocks and 7.8 ms at 1024 (a partial
#: 2048 x 512 tile costs far more than four 1024 x 512 ones); window 4096: 11.5 vs 10.8
_SPARSE_MAX_BLOCK_KV = 1024


def _table(device_kind: str | None):
    info = aot.find_chip(device_kind)
    if info is None:
        return _MEASURED["v5e"]
    if info.name in _MEASURED:
        return _MEASURED[info.name]
    return _MEASURED["v5e"] if info.vmem_bytes >= _LARGE_VMEM else {1 << 30: ((0, _SMALL),)}


def tuned_blocks(*, kv_len: int, head_dim: int | None = None, dtype=None, device_kind: str | None = None,
                 sparse: bool = False) -> TunedBlocks:
    """The tuned blocks for a kernel that sees ``kv_len`` keys with q's ``head_dim`` / ``dtype``
    (None: 128 / bfloat16) on ``device_kind`` (None: :func:`trace_chip`). Float32 inputs take
    the rows of twice their head size (their blocks take twice the VMEM). ``sparse`` (segment
    ids or a mask other than causal / full) takes no row with kv blocks over 1024. On a known chip the
    blocks are halved until the forward and the fused backward fit its VMEM (``splash/vmem.py``),
    so the default configuration is never refused there."""
    head_dim = 128 if head_dim is None else int(head_dim)
    dtype = np.dtype(jnp.bfloat16 if dtype is None else dtype)
    device_kind = trace_chip() if device_kind is None else device_kind
    table = _table(device_kind)
    row_dim = head_dim * 2 if dtype.itemsize >= 4 else head_dim
    rows = table[min(bound for bound in table if row_dim <= bound)]
    blocks = [blocks for start, blocks in rows
              if kv_len >= start and not (sparse and blocks.block_kv > _SPARSE_MAX_BLOCK_KV)][-1]
    return _within_vmem(blocks, aot.find_chip(device_kind), head_dim, dtype)


def _within_vmem(blocks: TunedBlocks, info, head_dim: int, dtype) -> TunedBlocks:
    """``blocks`` halved until the forward, the fused backward and the dq kernel fit the chip's VMEM
    (``splash/vmem.py``'s estimates with every optional operand present: partial mask blocks,
    positions and segment ids; unchanged on an unknown chip)."""
    if info is None:
        return blocks
    usable, name = usable_vmem_bytes(info), str(dtype)
    half = lambda b: max(b // 2, NUM_LANES)
    need = lambda kernel, shape, compute, out: KernelVmem(kernel, shape, compute, head_dim, head_dim, name, out, True,
                                                          None, q_side=2, kv_side=2).bytes
    while True:
        fwd = need("forward", (blocks.block_q, blocks.block_kv), blocks.block_kv_compute, name)
        bwd = need("fused", (blocks.block_q_dkv, blocks.block_kv_dkv), blocks.block_kv_dkv, "float32")
        # the ring's split backward runs the dq kernel at the forward's blocks
        dq = need("dq", (blocks.block_q, blocks.block_kv), blocks.block_kv, "float32")
        if max(fwd, bwd, dq) <= usable or max(blocks) <= NUM_LANES:
            return blocks
        if max(fwd, dq) > usable:
            blocks = blocks._replace(block_q=half(blocks.block_q), block_kv=half(blocks.block_kv),
                                     block_kv_compute=min(blocks.block_kv_compute, half(blocks.block_kv)))
        if bwd > usable:
            blocks = blocks._replace(block_q_dkv=half(blocks.block_q_dkv), block_kv_dkv=half(blocks.block_kv_dkv))
