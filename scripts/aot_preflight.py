"""Will this training step fit on that TPU slice? Compile it from a CPU machine and see.

Builds the model + AdamW training step of ``ringsplash.train`` for a TPU topology described
by libtpu (``jax.experimental.topologies.get_topology_desc``), lowers and compiles it ahead of
time with ``JAX_PLATFORMS=cpu`` (no TPU needed, ``pip install -e .[tpu]``), and prints the
per-device HBM use from ``compiled.memory_analysis()`` — arguments (params, optimiser state,
batch), outputs, temporaries — against the chip's capacity. Exits 1 when it does not fit.

    python scripts/aot_preflight.py --topology v5e:2x2 --seq-len 32768 --d-model 1024 --num-layers 8
    python scripts/aot_preflight.py --topology v6e:2x4 --data-parallel 2 --context-parallel 4 --remat

The mesh is (data x context) over the topology's devices; the ring runs over ``context``
(``--context-parallel`` defaults to every device). Compilation uses the Mosaic Splash kernels
(``--backend mosaic_tpu``), so it also proves that they lower for that chip.
"""

import dataclasses
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu probes for TPU metadata on import; on a CPU host tell it there is none to find.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from ringsplash.cli import parse_config  # noqa: E402 (after the environment and path set-up)

GiB = 1024**3
#: HBM per JAX device (bytes). One device per chip, except tpu7x (Ironwood): 192 GiB per chip
#: shared by its 2 TensorCores, each a JAX device (``v5p`` / ``v4`` megacore is one device).
HBM = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB, "tpu7x": 96 * GiB}
TOPOLOGIES = ("v5e:2x2", "v5e:2x4", "v5e:4x4", "v6e:2x2", "v6e:2x4", "v6e:4x4", "v5p:2x2x1", "v4:2x2x1", "tpu7x:2x2x1")


@dataclasses.dataclass(frozen=True)
class Config:
    topology: str = "v5e:2x2"
    data_parallel: int = 1
    context_parallel: int = 0  # 0: all devices / data_parallel
    seq_len: int = 32768
    batch_size: int = 0  # global rows; 0: data_parallel
    vocab_size: int = 32768
    d_model: int = 1024
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 8
    head_dim: int = 128
    mlp_ratio: float = 8 / 3
    layout: str = "zigzag"
    backend: str = "mosaic_tpu"
    block: int = 512
    remat: str = "none"  # none | full | save_attention | save_dots
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    mask: str = "causal"
    headroom: float = 0.9  # usable fraction of HBM


def parse_args(argv=None) -> Config:
    return parse_config(Config, argv, description=__doc__)


def chip_capacity(topology: str) -> int:
    kind = topology.split(":")[0]
    if kind not in HBM:
        raise SystemExit(f"unknown chip {kind!r} in topology {topology!r}: known {sorted(HBM)}")
    return HBM[kind]


def compile_step(config: Config):
    """Lower + compile one training step for ``config.topology``; returns (compiled, info)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from ringsplash import train
    from ringsplash.data import Batch
    from ringsplash.model import Transformer, TransformerConfig
    from ringsplash.splash import SplashConfig

    topo = topologies.get_topology_desc(config.topology, "tpu")
    devices = np.asarray(topo.devices).reshape(-1)
    data = config.data_parallel
    context = config.context_parallel or devices.size // data
    if data * context != devices.size:
        raise SystemExit(f"data_parallel={data} x context_parallel={context} must equal the {devices.size} devices "
                         f"of {config.topology}")
    mesh = Mesh(devices.reshape(data, context), (train.DATA, train.CONTEXT))
    b = config.block
    ring = context > 1
    model_config = TransformerConfig(
        vocab_size=config.vocab_size, d_model=config.d_model, num_layers=config.num_layers,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        mlp_ratio=config.mlp_ratio, max_seq_len=config.seq_len, mask=config.mask,
        attention="ring" if ring else "splash", ring_axis_name=train.CONTEXT if ring else None,
        ring_layout=config.layout, ring_size=context, remat=config.remat,
        param_dtype=config.param_dtype, compute_dtype=config.compute_dtype,
        splash=SplashConfig(block_q=b, block_kv=b, block_q_dkv=b, block_kv_dkv=b, backend=config.backend),
    )
    rows = config.batch_size or data
    tc = train.TrainConfig(steps=1000, batch_size=rows, data_parallel=data, context_parallel=context, warmup_steps=10)
    optimizer = train.make_optimizer(tc)

    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    model_abs = eqx.filter_eval_shape(Transformer, model_config, key=jax.random.key(0))
    params_abs, static = eqx.partition(model_abs, is_abstract)
    opt_abs = jax.eval_shape(optimizer.init, params_abs)
    replicated = NamedSharding(mesh, P())
    place = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), tree, is_leaf=is_abstract)
    seq_sharding = NamedSharding(mesh, train.batch_spec(model_config))
    batch_abs = Batch(
        *(jax.ShapeDtypeStruct((rows, config.seq_len), dt, sharding=seq_sharding)
          for dt in (jnp.int32, jnp.int32, jnp.float32, jnp.int32, jnp.int32))
    )
    grad_fn = train.make_grad_fn(model_config, mesh)

    def step(params, opt_state, batch):
        grads, metrics = grad_fn(params, static, batch, None)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    t0 = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(place(params_abs), place(opt_abs), batch_abs)
    compiled = lowered.compile()
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params_abs, is_leaf=is_abstract))
    info = {"devices": devices.size, "data": data, "context": context, "rows": rows, "params": n_params,
            "compile_s": time.perf_counter() - t0, "device_kind": getattr(devices[0], "device_kind", "?")}
    return compiled, info


def report(config: Config, compiled, info) -> bool:
    mem = compiled.memory_analysis()
    capacity = chip_capacity(config.topology)
    args = mem.argument_size_in_bytes
    outs = mem.output_size_in_bytes
    alias = mem.alias_size_in_bytes
    temp = mem.temp_size_in_bytes
    code = getattr(mem, "generated_code_size_in_bytes", 0)
    total = args + outs - alias + temp + code
    fits = total <= config.headroom * capacity
    gib = lambda x: f"{x / GiB:8.3f} GiB"  # noqa: E731
    print(f"topology {config.topology} ({info['device_kind']}, {info['devices']} devices): mesh data={info['data']} x "
          f"context={info['context']}; {info['params'] / 1e6:.1f} M params; batch {info['rows']} x {config.seq_len} "
          f"tokens; compiled in {info['compile_s']:.1f} s")
    print("per-device HBM:")
    print(f"  arguments    {gib(args)}   (params, optimiser state, batch shard)")
    print(f"  outputs      {gib(outs)}   ({gib(alias).strip()} aliased to donated arguments)")
    print(f"  temporaries  {gib(temp)}")
    print(f"  code         {gib(code)}")
    print(f"  total        {gib(total)}   of {gib(capacity).strip()} per device "
          f"({100 * total / capacity:.1f}%; limit {100 * config.headroom:.0f}%)")
    print("FITS" if fits else "DOES NOT FIT: lower seq_len / batch, add --remat, or use more chips")
    return fits


def main(config: Config) -> int:
    try:
        compiled, info = compile_step(config)
    except Exception as e:  # the TPU compiler itself refuses programs that exceed HBM
        message = str(e)
        if "Ran out of memory" not in message and "RESOURCE_EXHAUSTED" not in message:
            raise
        print(f"topology {config.topology}: the compiler reports the step exceeds HBM "
              f"({chip_capacity(config.topology) / GiB:.3f} GiB per device):")
        print("  " + message.strip().splitlines()[-1][:500])
        print("DOES NOT FIT: lower seq_len / batch, add --remat, or use more chips")
        return 1
    return 0 if report(config, compiled, info) else 1


if __name__ == "__main__":
    sys.exit(main(parse_args()))
