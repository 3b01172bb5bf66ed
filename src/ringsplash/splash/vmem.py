"""Scoped VMEM of the Splash kernels: the limit each call is compiled with, and a clear error
before Mosaic's own ``CompileTimeScopedVmemOom`` where a chip cannot hold a configuration.

Mosaic compiles a kernel under a scoped-VMEM limit (16 MiB by default on v5e, 32 MiB on v6e)
far below the VMEM a core has (128 MiB on v5e and v6e, 64 MiB on v5p), and fails when the
kernel's blocks, scratch and tile temporaries need more. So no kernel depends on a tight figure:
unless ``SplashConfig.vmem_limit_bytes`` says otherwise, each kernel call is compiled with twice its
estimate (at least 32 MiB), at most ``_LIMIT_SHARE`` (90%) of the VMEM of the chip it is traced on
(:func:`compile_limit`): not the whole ceiling, as VMEM a kernel's limit reserves is VMEM XLA cannot use
for the program's own buffers (``KernelVmem.limit``). A host that traces without a TPU
(CPU, or an ahead-of-time compile for a TPU target from a CPU host) cannot know the chip then; it
compiles with the largest such limit of the chips in ``aot.CHIPS`` (:func:`portable_limit`): a
limit is a ceiling, not an allocation (Mosaic allocates what the kernel needs), and the check
below, which runs when the chip is known, keeps every accepted kernel's need within the VMEM of
the chip it is lowered for.

The estimate (:attr:`KernelVmem.bytes`) only chooses blocks (``splash/tuning.py``) and refuses
what cannot fit. It counts every VMEM buffer at its tiled, padded shape (``tpu_tiles.tile_bytes``: rows to
the dtype's sublane tile, 8 x 32 bits / itemsize; columns to 128 lanes, so head sizes below 128
take 128 lanes), double-buffered blocks (q, k, v, dO, out, lse / delta rows, position and
segment-id columns / rows where they are VMEM blocks, the int8 mask block), scratch (float32
accumulators, m / l columns, dq slots), and tile temporaries

    a x (q block x kv block, float32) + b x (longest block x padded head size, float32)
  + c x (score tile, float32) for float32 inputs

with ``a, b, c`` fitted (forward; backward kernels) to the scoped sizes Mosaic reports compiling
for v5e (libtpu 0.0.42.1; blocks 256 ... 2048, head sizes 64 ... 256, bfloat16 and float32;
measured by ``scripts/calibrate_vmem.py``), then raised by ``_MARGIN``; beyond the fitted head
sizes (padded, over 256) the temporaries count ``_WIDE_TEMPS`` times. ``jax.vmap`` adds grid
dimensions, not block dimensions, so it changes nothing here.

:meth:`KernelVmem.check` runs in the TPU lowering rule of ``splash/guards.py::vmem_guard``, where
the chip is known: it raises a ValueError naming the kernel, the bytes, the limit and a
configuration that fits when the estimate exceeds ``usable_vmem_bytes`` (87.5% of the chip's VMEM,
below the 90% compiled with) or an explicit limit, or an explicit limit exceeds the chip's share.
An unknown chip lowers unchanged.
"""

import dataclasses

import numpy as np

from ringsplash import aot
from ringsplash.splash.tpu_tiles import NUM_LANES, NUM_SUBLANES, lanes, tile_bytes

__all__ = ["KernelVmem", "compile_limit", "kernel_vmem", "portable_limit", "usable_vmem_bytes"]

_MIB = 1 << 20
#: tile-temporary coefficients (a, b, c) (module docstring). Backward: least squares (non-negative)
#: on Mosaic's sizes for v5e, 21 fused-backward configurations. Forward: refitted after the mask
#: stopped living across the matmuls (its scoped size fell, 2048 x 2048 bf16: ~36 -> 30.6 MB), as
#: the smallest largest-ratio bound over 24 configurations (scripts/calibrate_vmem.py) with every
#: estimate >= 1.08x Mosaic's size: 1.08x at 2048 x 2048 (d 128), up to 2.9x for small blocks
_TEMPS = {"forward": (0.034, 7.8, 2.22), "backward": (1.58, 4.12, 1.29)}
#: estimate = fit x 1.3 + 1 MiB: Mosaic's size was at most 1.19x the fit (forward 2048 x 2048
#: blocks sliced by 512, whose four unrolled slices keep more temporaries alive)
_MARGIN = (1.3, _MIB)
#: the largest (padded) head size of the fit; above it the temporaries count ``_WIDE_TEMPS`` times: a float32
#: fused backward at head size 512, blocks (2048, 1024), needed 115-127 MiB on v5e where the fit said 111
#: (2026-12-07, found by tests/test_vmem_tpu_compile.py's near-limit draws)
_FITTED_HEAD, _WIDE_TEMPS = 256, 1.5
#: the share of a chip's VMEM a kernel is compiled with (its scoped limit; Pallas TPU kernels
#: commonly take 90% of ``vmem_capacity_bytes``); the rest stays with XLA
_LIMIT_SHARE = 0.9
#: the smallest limit a kernel is compiled with (v6e's default scoped VMEM)
_FLOOR = 32 * _MIB
#: the share one kernel's estimate may take before ringsplash refuses it: below ``_LIMIT_SHARE``
#: (an estimate short by 2.5% of the chip, 3 MiB on v5e, still compiles). Not lower: on v5p
#: (64 MiB) the causal 2048-blocks' bf16 fused backward (estimate 55.3 MiB) compiles in Mosaic
_USABLE = 0.875
#: the kernels whose dK/dV tiles are (kv, q): positions and segment ids are q rows, kv columns
_TRANSPOSED = ("dkv", "fused")


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
    explicit_limit: int | None  # SplashConfig.vmem_limit_bytes (None: set from the chip)
    q_side: int = 0  # position / segment-id operands along q that are VMEM blocks (q_pos, q_seg)
    kv_side: int = 0  # the same along kv (kv_pos, kv_seg)
    chip: str | None = None  # the device_kind traced on (None: unknown, e.g. an AOT compile from a CPU host)

    @property
    def bytes(self) -> int:
        """The estimate of the module docstring."""
        bq, bkv = self.block_shape
        d, dv = self.head_dim, self.head_dim_v
        pd, pdv = lanes(d), lanes(dv)  # lanes a head size takes
        item, out_item = np.dtype(self.dtype).itemsize, np.dtype(self.out_dtype).itemsize
        tile = tile_bytes
        row = 2 * tile(1, bq, 4)  # a double-buffered (1, bq) float32 row (lse, delta)
        column = tile(bq, NUM_LANES, 4)  # a lane-replicated (bq, 128) float32 column
        # positions / segment ids (int32): q columns and kv rows, or in the dK/dV kernel q rows and kv columns
        q_one, kv_one = ((tile(1, bq, 4), tile(bkv, NUM_LANES, 4)) if self.kernel in _TRANSPOSED
                         else (tile(bq, NUM_LANES, 4), tile(1, bkv, 4)))
        sides = 2 * (self.q_side * q_one + self.kv_side * kv_one)
        mask = 2 * tile(bq, bkv, 1) if self.mask_blocks else 0
        counts = 2 * 2 * tile(NUM_SUBLANES, NUM_LANES, 4)  # step counts, max-logit rows (when asked)
        qkv = tile(bq, d, item) + tile(bkv, d, item) + tile(bkv, dv, item)
        if self.kernel == "forward":
            blocks = 2 * qkv + 2 * tile(bq, dv, out_item) + row
            scratch = 3 * column + tile(bq, dv, 4) + (tile(bq, d, item) if item == 4 else 0)
            a, b, c = _TEMPS["forward"]
            sliced = c * bq * self.block_kv_compute * 4 if item == 4 else 0
            temps = a * bq * bkv * 4 + b * bq * max(pd, pdv) * 4 + sliced
        else:
            blocks = 2 * (qkv + tile(bq, dv, item)) + 2 * row
            if self.kernel == "dq":
                blocks += 2 * tile(bq, d, out_item)
                scratch = tile(bq, d, 4) + 2 * column
            else:
                blocks += 2 * (tile(bkv, d, out_item) + tile(bkv, dv, out_item))
                scratch = tile(bkv, d, 4) + tile(bkv, dv, 4) + (2 * tile(bq, d, 4) if self.kernel == "fused" else 0)
            a, b, c = _TEMPS["backward"]
            temps = (a * bq * bkv * 4 + b * max(bq, bkv) * max(pd, pdv) * 4
                     + (c * bq * bkv * 4 if item == 4 else 0))
        if max(pd, pdv) > _FITTED_HEAD:  # beyond the fitted head sizes the temporaries grew faster
            temps *= _WIDE_TEMPS
        need = blocks + scratch + sides + mask + counts + temps
        return int(need * _MARGIN[0] + _MARGIN[1])

    @property
    def limit(self) -> int:
        """The scoped limit the kernel is compiled with: the explicit one, else
        :func:`compile_limit` of the chip traced on (:func:`portable_limit` when unknown)."""
        if self.explicit_limit is not None:
            return self.explicit_limit
        info = aot.find_chip(self.chip)
        ceiling = portable_limit() if info is None else compile_limit(info)
        # Not the whole ceiling: VMEM a kernel's limit reserves is VMEM XLA cannot use for the program's own
        # buffers (ring fwd+bwd at 32K on v5e:2x2 took 385 instead of 229 MiB of HBM temporaries under a 115 MiB
        # limit). Twice the estimate leaves Mosaic room where the fitted estimate runs short (by 1.14x at worst).
        return min(ceiling, max(_FLOOR, -(-2 * self.bytes // _MIB) * _MIB))

    def check(self, chip: str | None) -> None:
        """Raise a ValueError when this call cannot compile on ``chip`` (a ``device_kind``)."""
        info = aot.find_chip(chip)
        if info is None:
            return
        need, cap = self.bytes, min(usable_vmem_bytes(info), self.limit)
        if self.explicit_limit is not None and need > self.explicit_limit:
            problem = f"over SplashConfig.vmem_limit_bytes={self.explicit_limit} ({self.explicit_limit / _MIB:.1f} MiB)"
        elif self.explicit_limit is not None and self.explicit_limit > compile_limit(info):
            raise ValueError(
                f"SplashConfig.vmem_limit_bytes={self.explicit_limit} ({self.explicit_limit / _MIB:.1f} MiB) is over "
                f"the {compile_limit(info) / _MIB:.0f} MiB a kernel may be compiled with on {info.name} ({chip!r}): "
                f"pass at most {compile_limit(info)}, or None (the limit set from the estimate and the chip; this "
                f"{self.kernel} kernel needs about {need / _MIB:.1f} MiB)")
        elif need > cap:
            problem = f"over the {cap / _MIB:.0f} MiB of VMEM a kernel may take on {info.name} ({chip!r})"
        else:
            return
        raise ValueError(
            f"the Splash {self.kernel} kernel with (block_q, block_kv)={self.block_shape}"
            + (f", block_kv_compute={self.block_kv_compute}" if self.kernel == "forward" else "")
            + f", head_dim={self.head_dim}, head_dim_v={self.head_dim_v} and {self.dtype} inputs needs about "
            f"{need / _MIB:.1f} MiB of scoped VMEM, {problem}: {self._fitting_hint(cap)}"
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
            hint += " or raise SplashConfig.vmem_limit_bytes (None sets it from the chip)"
        if smaller.bytes > usable:
            hint += "; the smallest blocks still need more: a smaller head size, or bfloat16 inputs"
        return hint


def usable_vmem_bytes(info: aot.ChipInfo) -> int:
    """The scoped VMEM one kernel's estimate may take on a chip (``_USABLE`` of its VMEM per core)."""
    return int(info.vmem_bytes * _USABLE)


def compile_limit(info: aot.ChipInfo) -> int:
    """The scoped-VMEM limit a kernel is compiled with on a chip: ``_LIMIT_SHARE`` of its VMEM
    per core, rounded down to a MiB."""
    return int(info.vmem_bytes * _LIMIT_SHARE) // _MIB * _MIB


def portable_limit() -> int:
    """The limit of a kernel traced without knowing its chip: the largest :func:`compile_limit` of
    the chips in ``aot.CHIPS`` (a ceiling; the lowering check keeps the need within the chip)."""
    return max(compile_limit(aot.chip(name)) for name in aot.CHIPS)


def _side_count(operands: dict, names: tuple[str, ...]) -> int:
    """How many of ``names`` are 2-D arrays in ``operands`` (lane-replicated columns / rows, the
    layout of a VMEM block; a scalar-memory table or an absent operand counts nothing)."""
    return sum(getattr(operands.get(name), "ndim", 0) == 2 for name in names)


def kernel_vmem(kernel: str, q, k, v, block_shape, *, block_kv_compute=None, out_dtype=None, operands: dict,
                vmem_limit_bytes) -> KernelVmem:
    """The :class:`KernelVmem` of a ``kernel`` call on ``q, k, v`` (arrays or shapes) with the
    keyword ``operands`` its wrapper takes (positions, segment ids, partial mask blocks); the chip
    is the one JAX traces on (``aot.trace_chip``)."""
    blocks = operands.get("mask_blocks_t" if kernel in _TRANSPOSED else "mask_blocks")
    return KernelVmem(
        kernel=kernel, block_shape=tuple(int(b) for b in block_shape),
        block_kv_compute=int(block_kv_compute or block_shape[1]), head_dim=int(q.shape[-1]),
        head_dim_v=int(v.shape[-1]), dtype=str(np.dtype(q.dtype)),
        out_dtype=str(np.dtype(q.dtype if out_dtype is None else out_dtype)), mask_blocks=blocks is not None,
        explicit_limit=vmem_limit_bytes, q_side=_side_count(operands, ("q_pos", "q_seg")),
        kv_side=_side_count(operands, ("kv_pos", "kv_seg")), chip=aot.trace_chip(),
    )
