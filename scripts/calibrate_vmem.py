"""Measure the scoped VMEM Mosaic allocates for each Splash kernel (ahead of time, on a CPU host
with libtpu) and compare it with ringsplash's estimate (``splash/vmem.py``).

Mosaic reports, when a kernel exceeds its scoped-VMEM limit, the cumulative allocation at which
it failed; raising the limit to each reported size until the compile succeeds gives the kernel's
size. One JSON line per configuration (kernel, blocks, head size, dtype, Mosaic's bytes, the
estimate and their ratio). The estimate chooses blocks and refuses what cannot fit; each kernel is
compiled with 90% of the chip's VMEM as its limit, so a ratio a little under 1 is no failure, but
the refusals are only as right as the ratio is close to 1 or above.

    JAX_PLATFORMS=cpu python scripts/calibrate_vmem.py --target v5e:2x2 > vmem.jsonl
"""

import argparse
import json
import os
import re

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np

import ringsplash as rs
from ringsplash import aot, masks
from ringsplash.blocksparse.mask_info import build_mask_info
from ringsplash.splash.vmem import KernelVmem

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
BLOCKS = ((1024, 1024), (512, 512), (2048, 1024), (1024, 512), (256, 256), (2048, 2048))
DIMS = ((128, "bfloat16"), (256, "bfloat16"), (64, "bfloat16"), (128, "float32"))


def mosaic_bytes(target: str, kernel: str, bq: int, bkv: int, compute: int, d: int, dtype: str,
                 seq_len: int = 4096) -> int | None:
    """Mosaic's scoped VMEM of one kernel (causal mask, 4 heads), or None if it never compiles.
    ringsplash's own check (``KernelVmem.check``) is off meanwhile: the limits tried are below it."""
    limit = 1 << 20
    for _ in range(64):
        found = scoped_oom(target, kernel, bq, bkv, compute, d, dtype, limit, seq_len)
        if found is None:
            return limit
        if not found:
            return None
        limit = max(found + (16 << 10), limit + (16 << 10))
    return None


def scoped_oom(target: str, kernel: str, bq: int, bkv: int, compute: int, d: int, dtype: str, limit: int,
               seq_len: int = 4096) -> int | None:
    """Compile one kernel (causal mask, 4 heads) with a scoped-VMEM limit of ``limit`` bytes: None if it
    compiles, else the size (bytes, rounded up to a KiB) of the allocation Mosaic ran out at, or 0 when the
    compile failed for another reason. ringsplash's own check (``KernelVmem.check``) is off meanwhile."""
    check, KernelVmem.check = KernelVmem.check, lambda self, chip: None
    try:
        return _scoped_oom(target, kernel, bq, bkv, compute, d, dtype, limit, seq_len)
    finally:
        KernelVmem.check = check


def _scoped_oom(target, kernel, bq, bkv, compute, d, dtype, limit, seq_len):
    sharding = jax.sharding.SingleDeviceSharding(aot.topology_devices(target)[0])
    spec = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=sharding)
    mask = masks.CausalMask((seq_len, seq_len))
    info, info_t = build_mask_info(mask, (bq, bkv)), build_mask_info(mask, (bq, bkv), transpose=True)
    qkv = (spec((4, seq_len, d)),) * 3
    config = rs.SplashConfig(block_q=bq, block_kv=bkv, block_kv_compute=compute, block_q_dkv=bq,
                             block_kv_dkv=bkv, backend="mosaic_tpu", vmem_limit_bytes=limit)
    if kernel == "forward":
        fn, args = (lambda q, k, v, c=config: rs.splash_forward(q, k, v, info, config=c)), qkv
    else:
        parts = {"dq": ("dq",), "dkv": ("dkv",), "fused": ("dq", "dkv")}[kernel]
        fn = lambda q, k, v, do, lse, c=config, p=parts: rs.splash_backward(q, k, v, do, lse, lse, info, info_t,
                                                                           config=c, parts=p)
        args = (*qkv, spec((4, seq_len, d)), spec((4, seq_len), "float32"))
    try:
        aot.compile_report(fn, *args)
        return None
    except Exception as exc:
        found = re.search(r"Scoped allocation with size ([\d.]+)([KMG]) and limit", str(exc))
        if not found:
            return 0
        return int(np.ceil(float(found.group(1)) * _UNITS[found.group(2)] / 1024)) * 1024


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--target", default="v5e:2x2", help="TPU topology to compile for (default %(default)s)")
    parser.add_argument("--kernels", default="forward,fused,dq", help="kernels to measure, comma-separated")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    for kernel in args.kernels.split(","):
        for bq, bkv in BLOCKS:
            for d, dtype in DIMS:
                compute = 512 if kernel == "forward" and bkv >= 1024 else bkv
                size = mosaic_bytes(args.target, kernel, bq, bkv, compute, d, dtype)
                out_dtype = dtype if kernel == "forward" else "float32"
                estimate = KernelVmem(kernel, (bq, bkv), compute, d, d, dtype, out_dtype, True, None).bytes
                print(json.dumps(dict(kernel=kernel, blocks=[bq, bkv, compute], head_dim=d, dtype=dtype,
                                      mosaic=size, estimate=estimate,
                                      ratio=None if not size else round(estimate / size, 3))), flush=True)


if __name__ == "__main__":
    main()
