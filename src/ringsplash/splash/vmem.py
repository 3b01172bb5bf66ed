"""Scoped-VMEM check of the Splash forward kernel: a clear error naming the block shape, the
head sizes, the dtype and the chip, before Mosaic's own ``CompileTimeScopedVmemOom``.

Mosaic accepts any head size (compiled for v5e: 1, 8, 17, 32 ... 1024 in bfloat16 with
512-blocks, none needs to be a multiple of 8 or 128: a block's head axis is the whole array
axis). What it rejects is a kernel whose scoped VMEM exceeds the chip's limit, and the forward
kernel, which holds q, k, v and out blocks plus a float32 accumulator, is the one that hits it
first as the head size grows. Its scoped allocation is at least (measured against Mosaic's
reported size: equal for float32, within 0.5 MiB above for bfloat16):

    2 x (bq x d + bkv x d + bkv x dv) x itemsize        double-buffered q, k, v blocks
  + 2 x bq x dv x out itemsize                          double-buffered out block
  + 4 x bq x dv + 2 x 4 x bq x 128                      float32 acc, m, l scratch
  + 2 x bq x bkv                                        double-buffered int8 mask block (if any)

The chip is known only when the computation is lowered for TPU (an ahead-of-time compile from
a CPU host traces without it), so ``ForwardVmem.check`` runs in the TPU lowering rule of
``splash/guards.py::vmem_guard``. An unknown chip or a configuration under the limit lowers
unchanged.
"""

import dataclasses

import numpy as np

from ringsplash import aot
from ringsplash.splash.config import NUM_LANES

__all__ = ["ForwardVmem", "forward_vmem"]

_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class ForwardVmem:
    """What the forward kernel of one call needs (hashable: a static primitive parameter)."""

    block_shape: tuple[int, int]
    head_dim: int
    head_dim_v: int
    dtype: str
    out_dtype: str
    vmem_limit_bytes: int | None  # SplashConfig.vmem_limit_bytes (None: the chip's default)
    mask_blocks: bool  # partial mask blocks are stored (an int8 block operand)

    @property
    def bytes(self) -> int:
        """Lower bound of the kernel's scoped VMEM (module docstring)."""
        bq, bkv = self.block_shape
        item, out_item = np.dtype(self.dtype).itemsize, np.dtype(self.out_dtype).itemsize
        blocks = 2 * (bq * self.head_dim + bkv * self.head_dim + bkv * self.head_dim_v) * item
        out = 2 * bq * self.head_dim_v * out_item
        scratch = 4 * bq * self.head_dim_v + 2 * 4 * bq * NUM_LANES
        return blocks + out + scratch + (2 * bq * bkv if self.mask_blocks else 0)

    def check(self, chip: str | None) -> None:
        """Raise a ValueError when the bound exceeds the limit on ``chip`` (a ``device_kind``)."""
        limit = self.vmem_limit_bytes
        if limit is None:
            limit = getattr(aot.find_chip(chip), "scoped_vmem_bytes", None)  # ringsplash.aot's chip table
        need = self.bytes
        if limit is None or need <= limit:
            return
        bq, bkv = self.block_shape
        source = "SplashConfig.vmem_limit_bytes" if self.vmem_limit_bytes is not None else "the default scoped limit"
        raise ValueError(
            f"the Splash forward kernel with (block_q, block_kv)={self.block_shape}, head_dim={self.head_dim}, "
            f"head_dim_v={self.head_dim_v} and {self.dtype} inputs needs at least {need / _MIB:.2f} MiB of VMEM "
            f"(double-buffered q/k/v/out blocks and a float32 accumulator) on chip {chip!r}, over {source} "
            f"of {limit / _MIB:.2f} MiB: use smaller blocks (e.g. SplashConfig(block_q={max(bq // 2, NUM_LANES)}, "
            f"block_kv={max(bkv // 2, NUM_LANES)})) or raise SplashConfig.vmem_limit_bytes"
        )


def forward_vmem(q, k, v, block_shape, *, out_dtype, vmem_limit_bytes, mask_blocks: bool) -> ForwardVmem:
    """The :class:`ForwardVmem` of a forward kernel call on ``q, k, v``."""
    return ForwardVmem(
        block_shape=tuple(int(b) for b in block_shape), head_dim=int(q.shape[-1]), head_dim_v=int(v.shape[-1]),
        dtype=str(np.dtype(q.dtype)), out_dtype=str(np.dtype(q.dtype if out_dtype is None else out_dtype)),
        vmem_limit_bytes=vmem_limit_bytes, mask_blocks=bool(mask_blocks),
    )
