"""On a TPU chip: max abs error of Splash's output and gradients against the float32 oracle
(``reference_attention`` in float32 at ``precision="highest"``), per input dtype, backend and
``SplashConfig.precision``; prints a markdown table.

    python scripts/tpu_numerics.py              # causal, S = 2048, 4 heads, d = 128 (~1 min on a v5e)
"""

import argparse
import functools
import sys

import jax
import jax.numpy as jnp

import ringsplash as rs
from ringsplash import masks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--seq-len", type=int, default=2048, help="S (default %(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="heads (default %(default)s)")
    parser.add_argument("--head-dim", type=int, default=128, help="head size (default %(default)s)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    device = jax.devices()[0]
    if device.platform != "tpu":
        sys.exit(f"tpu_numerics.py measures the TPU kernels; this process sees {device.platform!r} devices")
    s, h, d = args.seq_len, args.heads, args.head_dim
    mask = masks.CausalMask((s, s))
    keys = jax.random.split(jax.random.key(1), 4)
    f32 = lambda x: x.astype(jnp.float32)
    print(f"device: {device.device_kind}, jax {jax.__version__}; causal S={s}, {h} heads, d={d}")
    print("| inputs | backend, precision | out | dq | dk | dv |\n|---|---|---|---|---|---|")
    for dtype in (jnp.float32, jnp.bfloat16):
        q, k, v, do = (jax.random.normal(key, (h, s, d), dtype) for key in keys)

        def loss(fn, q, k, v, do=do):
            return jnp.vdot(fn(q, k, v).astype(jnp.float32), do.astype(jnp.float32))

        oracle = lambda q, k, v: rs.reference_attention(f32(q), f32(k), f32(v), mask)
        with jax.default_matmul_precision("highest"):
            ref_out = jax.jit(oracle)(q, k, v)
            ref_grads = jax.jit(jax.grad(functools.partial(loss, oracle), argnums=(0, 1, 2)))(q, k, v)
        for backend, precision in (("mosaic_tpu", "auto"), ("mosaic_tpu", "default"), ("xla", "auto")):
            config = rs.SplashConfig(backend=backend, precision=precision)
            fn = lambda q, k, v, c=config: rs.splash_attention(q, k, v, mask, config=c)
            out = jax.jit(fn)(q, k, v)
            grads = jax.jit(jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2)))(q, k, v)
            errs = [jnp.max(jnp.abs(f32(out) - ref_out))] + [jnp.max(jnp.abs(f32(g) - r))
                                                              for g, r in zip(grads, ref_grads)]
            print(f"| {jnp.dtype(dtype).name} | {backend}, {precision!r} | "
                  + " | ".join(f"{float(e):.1e}" for e in errs) + " |", flush=True)


if __name__ == "__main__":
    main()
