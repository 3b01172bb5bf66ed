"""Scoped VMEM of the Splash kernels: the limit each call is compiled with, and a clear error
before Mosaic's own ``CompileTimeScopedVmemOom`` where a chip cannot hold a configuration.

Mosaic compiles a kernel under a scoped-VMEM limit (16 MiB by default on v5e, 32 MiB on v6e)
far below the VMEM a core has (128 MiB on v5e and v6e), and fails when the kernel's blocks,
scratch and tile temporaries need more. A kernel's need is estimated here as

    double-buffered blocks (q, k, v, dO, out, lse / delta rows, int8 mask block, outputs)
  + scratch (float32 accumulators, m / l columns, dq slots)
  + tile temporaries: a x (q block x kv block, float32) + b x (longest block x head size,
                      float32) + c x (score tile, float32) for float32 inputs

with ``a, b, c`` fitted (forward; backward kernels) to the scoped sizes Mosaic reports compiling
for v5e (libtpu 0.0.42.1; blocks 256 ... 2048, head sizes 64 ... 256, bfloat16 and float32;
measured by ``scripts/calibrate_vmem.py``), then raised by ``_MARGIN`` so that the estimate
bounds every measured size from above. Each kernel call is compiled with that bound as its
limit when it exceeds the smallest default (``SplashConfig.vmem_limit_bytes=None``), so a
configuration the chip can hold never fails in Mosaic; an explicit limit is honoured.

The chip is known only when the computation is lowered for TPU (an ahead-of-time compile from a
CPU host traces without it), so :meth:`KernelVmem.check` runs in the TPU lowering rule of
``splash/guards.py::vmem_guard``: it raises a ValueError naming the kernel, the bytes, the limit
and a configuration that fits when the limit exceeds the chip's VMEM or the estimate exceeds an
explicit limit. An unknown chip lowers unchanged.
"""

import dataclasses

import numpy as np

from ringsplash import aot
from ringsplash.splash.tpu_tiles import NUM_LANES, NUM_SUBLANES

__all__ = ["KernelVmem", "kernel_vmem", "usable_vmem_bytes"]

_MIB = 1 << 20
#: the smallest default scoped limit of the chips in ``aot.CHIPS`` (v5e); under it no limit is set
_DEFAULT_SCOPED = 16 * _MIB
#: tile-temporary coefficients (a, b, c) (module docstring). Backward: least squares (non-negative)
#: on Mosaic's sizes for v5e, 21 fused-backward configurations. Forward: refitted after the mask
#: stopped living across the matmuls (its scoped size fell, 2048 x 2048 bf16: ~36 -> 30.6 MB), as
#: the smallest largest-ratio bound over 24 configurations (scripts/calibrate_vmem.py) with every
#: estimate >= 1.08x Mosaic's size: 1.08x at 2048 x 2048 (d 128), up to 2.9x for small blocks
_TEMPS = {"forward": (0.034, 7.8, 2.22), "backward": (1.58, 4.12, 1.29)}
#: estimate = fit x 1.3 + 1 MiB: Mosaic's size was at most 1.19x the fit (forward 2048 x 2048
#: blocks sliced by 512, whose four unrolled slices keep more temporaries alive)
_MARGIN = (1.3, _MIB)
#: a chip keeps this share of its VMEM for anything but one kernel's scoped allocation
_USABLE = 0.85


@dataclasses.dataclass(frozen=True)
class KernelVmem:
    """What one Splash kernel call needs (hashable: a static primitive parameter)."""

    kernel: str  # "forward", "dq", "dkv" or "fused" (dK/dV with dq accumulated)
    block_shape: tuple[int, int]  # the kernel's (q, kv) tile
    block_kv_compute: int  # forward: kv slice of a score tile; others: block_shape[1]
    head_dim: int
    head_dim_v: int
    dtype: str
    out_dtype: str
    mask_blocks: bool  # partial mask blocks are stored (an int8 block operand)
    explicit_limit: int | None  # SplashConfig.vmem_limit_bytes (None: set from the estimate)

    @property
    def bytes(self) -> int:
        """The estimate of the module docstring (an upper bound of Mosaic's scoped size)."""
        bq, bkv = self.block_shape
        d, dv = self.head_dim, self.head_dim_v
        item, out_item = np.dtype(self.dtype).itemsize, np.dtype(self.out_dtype).itemsize
        row = 2 * NUM_SUBLANES * bq * 4  # a double-buffered (1, bq) float32 row pads to 8 sublanes
        column = bq * NUM_LANES * 4  # a lane-replicated (bq, 128) float32 column
        mask = 2 * bq * bkv if self.mask_blocks else 0
        if self.kernel == "forward":
            blocks = 2 * (bq * d + bkv * d + bkv * dv) * item + 2 * bq * dv * out_item + row
            scratch = 2 * column + bq * dv * 4 + (bq * d * item if item == 4 else 0)
            a, b, c = _TEMPS["forward"]
            sliced = c * bq * self.block_kv_compute * 4 if item == 4 else 0
            temps = a * bq * bkv * 4 + b * bq * max(d, dv) * 4 + sliced
        else:
            blocks = 2 * (bq * d + bkv * d + bkv * dv + bq * dv) * item + 2 * row
            if self.kernel == "dq":
                blocks += 2 * bq * d * out_item
                scratch = bq * d * 4 + 2 * column
            else:
                blocks += 2 * bkv * (d + dv) * out_item
                scratch = bkv * (d + dv) * 4 + (2 * bq * d * 4 if self.kernel == "fused" else 0)
            a, b, c = _TEMPS["backward"]
            temps = a * bq * bkv * 4 + b * max(bq, bkv) * max(d, dv) * 4 + (c * bq * bkv * 4 if item == 4 else 0)
        return int((blocks + scratch + mask + temps) * _MARGIN[0] + _MARGIN[1])

    @property
    def limit(self) -> int | None:
        """The scoped limit the kernel is compiled with: the explicit one, else the estimate
        rounded up to a MiB when it exceeds the smallest default (None: the chip's default)."""
        if self.explicit_limit is not None:
            return self.explicit_limit
        need = self.bytes
        return None if need <= _DEFAULT_SCOPED else -(-need // _MIB) * _MIB

    def check(self, chip: str | None) -> None:
        """Raise a ValueError when this call cannot compile on ``chip`` (a ``device_kind``)."""
        info = aot.find_chip(chip)
        if info is None:
            return
        need, limit = self.bytes, self.limit
        usable = usable_vmem_bytes(info)
        if self.explicit_limit is not None and need > self.explicit_limit:
            problem = f"over SplashConfig.vmem_limit_bytes={self.explicit_limit} ({self.explicit_limit / _MIB:.1f} MiB)"
        elif (limit or 0) > usable:
            problem = f"over the {usable / _MIB:.0f} MiB of VMEM a kernel may take on {info.name} ({chip!r})"
        else:
            return
        raise ValueError(
            f"the Splash {self.kernel} kernel with (block_q, block_kv)={self.block_shape}"
            + (f", block_kv_compute={self.block_kv_compute}" if self.kernel == "forward" else "")
            + f", head_dim={self.head_dim}, head_dim_v={self.head_dim_v} and {self.dtype} inputs needs about "
            f"{need / _MIB:.1f} MiB of scoped VMEM, {problem}: {self._fitting_hint(usable)}"
        )

    def _fitting_hint(self, usable: int) -> str:
        """A config that fits: the blocks halved until the estimate does."""
        smaller = self
        while smaller.bytes > min(usable, self.explicit_limit or usable) and max(smaller.block_shape) > NUM_LANES:
            bq, bkv = (max(b // 2, NUM_LANES) for b in smaller.block_shape)
            smaller = dataclasses.replace(smaller, block_shape=(bq, bkv),
                                          block_kv_compute=min(smaller.block_kv_compute, bkv))
        bq, bkv = smaller.block_shape
        names = {"forward": ("block_q", "block_kv"), "dq": ("block_q", "block_kv")}.get(
            self.kernel, ("block_q_dkv", "block_kv_dkv"))
        hint = f"use SplashConfig({names[0]}={bq}, {names[1]}={bkv}"
        if self.kernel == "forward":
            hint += f", block_kv_compute={smaller.block_kv_compute}"
        hint += f") (about {smaller.bytes / _MIB:.1f} MiB)"
        if self.explicit_limit is not None:
            hint += " or raise SplashConfig.vmem_limit_bytes (None sets it from this estimate)"
        return hint


def usable_vmem_bytes(info: aot.ChipInfo) -> int:
    """The scoped VMEM one kernel may take on a chip (``_USABLE`` of its VMEM per core)."""
    return int(info.vmem_bytes * _USABLE)


def kernel_vmem(kernel: str, q, k, v, block_shape, *, block_kv_compute=None, out_dtype=None, mask_blocks: bool,
                vmem_limit_bytes) -> KernelVmem:
    """The :class:`KernelVmem` of a ``kernel`` call on ``q, k, v`` (arrays or shapes)."""
    return KernelVmem(
        kernel=kernel, block_shape=tuple(int(b) for b in block_shape),
        block_kv_compute=int(block_kv_compute or block_shape[1]), head_dim=int(q.shape[-1]),
        head_dim_v=int(v.shape[-1]), dtype=str(np.dtype(q.dtype)),
        out_dtype=str(np.dtype(q.dtype if out_dtype is None else out_dtype)), mask_blocks=bool(mask_blocks),
        explicit_limit=vmem_limit_bytes,
    )
