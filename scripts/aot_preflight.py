"""Will this training step fit on that TPU slice? Compile it from a CPU machine and see.

Builds the model + AdamW training step of ``ringsplash.train`` for a TPU topology described
by libtpu (``jax.experimental.topologies.get_topology_desc``), lowers and compiles it ahead of
time with ``JAX_PLATFORMS=cpu`` (no TPU needed, ``pip install -e .[tpu]``), and prints the
per-device HBM use from ``compiled.memory_analysis()`` — arguments (params, optimiser state,
batch), outputs, temporaries — against the chip's capacity. Exits 1 when it does not fit.

    python scripts/aot_preflight.py --topology v5e:2x2 --seq-len 32768 --d-model 1024 --num-layers 8
    python scripts/aot_preflight.py --topology v6e:2x4 --data-parallel 2 --context-parallel 4 --remat full
    python scripts/aot_preflight.py --preset llama3-8b --topology v5p:4x4x4 --data-parallel 4 --seq-len 262144 \
        --remat full --loss-chunk 4096
    python scripts/aot_preflight.py --preset 1b --topology v5e:2x4 --remat full --loss-chunk 2048 --find-max-seq-len
    python scripts/aot_preflight.py --topology v5e:1x1 --seq-len 65536 --d-model 1024 --remat full --find-max-layers
    python scripts/aot_preflight.py --hf-config path/to/config.json --topology v5p:4x4x4 --seq-len 131072 --remat full

``--hf-config`` takes the model from a Hugging Face config.json (or a checkpoint directory; no
weights are read): its shape and every family feature (``ringsplash.hf.config_from_hf``); the run
flags (``--seq-len``, topology, parallelism, layout, blocks, remat, dtypes, loss chunk) apply on
top. The model flags (``--d-model``, ``--num-layers``, ..., ``--mask``, the RoPE flags, ``--preset``)
then must stay unset: the file says them.

Parameters and AdamW state are sharded over data x context (``--no-fsdp``: replicated); the
report splits the arguments into parameters / optimiser state / batch and names the biggest
temporaries (analytic estimates next to the compiler's total). ``--find-max-seq-len`` doubles
``--seq-len`` while the step fits in ``headroom`` x HBM, then bisects in multiples of the ring's
block granularity, and prints the report at the longest length found; ``--find-max-layers`` does the
same over ``--num-layers`` at ``--seq-len`` (one layer at a time). ``--topology v5e:1x1`` is one chip.

The mesh is (data x context) over the topology's devices; the ring runs over ``context``
(``--context-parallel`` defaults to every device). Compilation uses the Mosaic Splash kernels
(``--backend mosaic_tpu``), so it also proves that they lower for that chip.
"""

import dataclasses
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu probes for TPU metadata on import; on a CPU host tell it there is none to find.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
from ringsplash import aot
from ringsplash.cli import check_flags, check_optional_flags, flag_error, parse_config, run_script

GiB = aot.GiB
TOPOLOGIES = ("v5e:2x2", "v5e:2x4", "v5e:4x4", "v6e:2x2", "v6e:2x4", "v6e:4x4", "v5p:2x2x1", "v5p:4x4x4", "v4:2x2x1",
              "tpu7x:2x2x1")


@dataclasses.dataclass(frozen=True)
class Config:
    topology: str = "v5e:2x2"  # the TPU slice to compile for (e.g. v5e:2x4, v6e:2x2, v5p:4x4x4)
    preset: str = ""  # a ringsplash.model.presets name: its shape becomes the default of the model flags; "" = none
    #: a Hugging Face config.json or checkpoint directory: the model (shape and features) from it, the run flags on
    #: top; "" = the model flags below
    hf_config: str = ""
    data_parallel: int = 1  # devices on the mesh's data axis
    context_parallel: int = 0  # devices on the ring; 0 = auto: every device not on the data axis (devices / data_parallel)
    seq_len: int = 32768  # tokens per row (the model's max_seq_len)
    batch_size: int = 0  # global rows; 0 = auto: data_parallel (one row per data shard)
    vocab_size: int = 32768  # token vocabulary
    d_model: int = 1024  # model width
    num_layers: int = 8  # transformer layers
    num_heads: int = 8  # query heads
    num_kv_heads: int = 8  # key/value heads (GQA: divides num_heads)
    head_dim: int = 128  # per-head size of queries, keys and values
    mlp_ratio: float = 8 / 3  # SwiGLU hidden width / d_model (rounded up to mlp_multiple)
    mlp_multiple: int = 8  # the SwiGLU hidden width is a multiple of this
    rope_theta: float = 10_000.0  # RoPE base frequency
    #: RoPE scaling with Hugging Face's numerics: "" = none | linear | dynamic | yarn | llama3
    #: (dynamic / yarn / llama3 also need --rope-original-max-len)
    rope_scaling: str = ""
    rope_factor: float = 0.0  # RoPE scaling factor (context extension ratio); 0 = unset (needed with --rope-scaling)
    rope_original_max_len: int = 0  # the length the model was trained at; 0 = unset (needed except for linear)
    layout: str = "zigzag"  # token layout over the ring: contiguous | zigzag | striped
    backend: str = "mosaic_tpu"  # Splash backend: auto | mosaic_tpu | interpret | xla
    block: int = 512  # Splash block size (tokens), every block of the kernels
    remat: str = "none"  # rematerialisation of each layer: none | full | save_attention | save_dots
    fsdp: bool = True  # shard params + AdamW state over data x context
    loss_chunk: int = 0  # tokens per cross-entropy chunk; 0 = all local tokens at once
    param_dtype: str = "float32"  # parameter (and AdamW state) dtype: float32 | bfloat16 | float16
    compute_dtype: str = "bfloat16"  # activation dtype: float32 | bfloat16 | float16
    mask: str = "causal"  # attention mask: causal | full (the others need sizes this script does not set)
    headroom: float = 0.9  # usable fraction of HBM
    #: search the longest seq_len that fits (doubling from --seq-len, then bisecting)
    find_max_seq_len: bool = False
    max_search_len: int = 1 << 24  # the search stops doubling here
    #: search the most layers that fit at --seq-len (doubling from --num-layers, then bisecting)
    find_max_layers: bool = False
    max_search_layers: int = 512  # the layer search stops doubling here

    def __post_init__(self):
        """Each flag checked at once, its error naming the flag (the library's configs would name their
        own fields, e.g. ``max_seq_len`` for ``--seq-len``)."""
        from ringsplash.layouts import LAYOUTS
        from ringsplash.model.config import DTYPES, REMAT_POLICIES
        from ringsplash.splash.config import BACKENDS

        check_flags(self, choices={"layout": LAYOUTS, "backend": BACKENDS, "remat": REMAT_POLICIES,
                                   "param_dtype": DTYPES, "compute_dtype": DTYPES, "mask": ("causal", "full")},
                    positive=("data_parallel", "seq_len", "vocab_size", "d_model", "num_layers", "num_heads",
                              "num_kv_heads", "head_dim", "mlp_multiple", "block", "max_search_len",
                              "max_search_layers"),
                    non_negative=("context_parallel", "batch_size", "rope_original_max_len", "loss_chunk"),
                    positive_numbers=("mlp_ratio", "rope_theta"), fractions=("headroom",))
        if self.block % 128:
            raise flag_error("block", self.block, "a multiple of 128 tokens (the kernels' lanes)")
        check_optional_flags(self, unset=0, positive_numbers=("rope_factor",))
        if self.hf_config and not os.path.exists(self.hf_config):
            raise flag_error("hf_config", self.hf_config, "a Hugging Face config.json or a checkpoint directory "
                                                          "holding one: no such file or directory")


def parse_args(argv=None) -> Config:
    from ringsplash.model.presets import PRESETS

    return parse_config(Config, argv, description=__doc__, presets=PRESETS)


#: the flags that describe the model itself: with --hf-config the file says them (the --rope-* flags
#: still apply there: they extend the pretrained model's context)
MODEL_FLAGS = ("preset", "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_ratio",
               "mlp_multiple", "rope_theta", "mask")


def build_model_config(config: Config, **run):
    """The ``TransformerConfig`` of ``config``'s model with the run options ``run`` (strategy, length,
    dtypes, blocks, remat): from ``--hf-config`` (``ringsplash.hf.config_from_hf``) or the model flags."""
    from ringsplash.model import ModelFeatures, TransformerConfig, rope_scaling_from_flags

    if config.hf_config:
        defaults = Config()
        given = [f"--{f.replace('_', '-')}" for f in MODEL_FLAGS if getattr(config, f) != getattr(defaults, f)]
        if given:
            raise ValueError(f"--hf-config={config.hf_config!r} describes the model: drop {', '.join(given)} (or "
                             f"edit a copy of the config.json)")
        from ringsplash.hf import config_from_hf
        from ringsplash.hf.config import max_position_embeddings

        model = config_from_hf(config.hf_config, **run)
        if not config.rope_scaling:
            return model
        # a context extension of the pretrained model: a new RoPE scaling; dynamic / yarn / llama3 start
        # from the length it was trained at (its max_position_embeddings) unless the flag says otherwise
        trained = config.rope_original_max_len or (0 if config.rope_scaling == "linear" else max_position_embeddings(
            config.hf_config))
        scaling = rope_scaling_from_flags(config.rope_scaling, config.rope_factor, trained)
        return model.replace(features=model.features.replace(rope_scaling=scaling))
    return TransformerConfig(
        vocab_size=config.vocab_size, d_model=config.d_model, num_layers=config.num_layers,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        mlp_ratio=config.mlp_ratio, mlp_multiple=config.mlp_multiple, rope_theta=config.rope_theta, mask=config.mask,
        features=ModelFeatures(rope_scaling=rope_scaling_from_flags(config.rope_scaling, config.rope_factor,
                                                                    config.rope_original_max_len)),
        **run)


def run_options(config: Config, context: int) -> dict:
    """The ``TransformerConfig`` fields the run flags set (not the model's own)."""
    from ringsplash.model import ContextParallel
    from ringsplash.splash import SplashConfig

    b = config.block
    cp = ContextParallel("ring", ring_size=context, layout=config.layout) if context > 1 else ContextParallel(
        "splash", layout=config.layout)
    return dict(max_seq_len=config.seq_len, context_parallel=cp, remat=config.remat, param_dtype=config.param_dtype, compute_dtype=config.compute_dtype,
                splash=SplashConfig(block_q=b, block_kv=b, block_q_dkv=b, block_kv_dkv=b, backend=config.backend))


def chip_capacity(topology: str) -> int:
    """HBM bytes per device of the topology's chip (``ringsplash.aot``'s chip table)."""
    try:
        return aot.chip(topology).hbm_bytes
    except ValueError as e:
        raise SystemExit(f"unknown chip in topology {topology!r}: {e}") from None


def _mesh_shape(config: Config, num_devices: int) -> tuple[int, int]:
    data = config.data_parallel
    context = config.context_parallel or num_devices // data
    if data * context != num_devices:
        raise ValueError(f"--data-parallel {data} x --context-parallel {context} must equal the {num_devices} "
                         f"devices of --topology {config.topology}")
    return data, context


def granularity(config: Config, context: int) -> int:
    """Sequence lengths the step accepts are multiples of this: the ring's (2 x context for
    zigzag, else context) x block, and context x loss_chunk so the chunk divides local tokens."""
    parts = (2 * context if config.layout == "zigzag" else context) if context > 1 else 1
    g = parts * config.block
    if config.loss_chunk:
        g = math.lcm(g, context * config.loss_chunk)
    return g


def compile_step(config: Config):
    """Lower + compile one training step for ``config.topology``; returns (``aot.AotReport``, info)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding

    from ringsplash import partitioning, train
    from ringsplash.data import Batch
    from ringsplash.model import abstract_model
    from ringsplash.model.schedule import schedule_bytes_per_device

    devices = aot.topology_devices(config.topology)
    data, context = _mesh_shape(config, devices.size)
    mesh = aot.topology_mesh(config.topology, (train.DATA, train.CONTEXT), (data, context))
    model_config = build_model_config(config, **run_options(config, context))
    rows = config.batch_size or data
    tc = train.TrainConfig(steps=1000, batch_size=rows, data_parallel=data, warmup_steps=10, fsdp=config.fsdp,
                           loss_chunk=config.loss_chunk)  # the context axis: the model's (context_parallel)
    optimizer = train.make_optimizer(tc)
    plan = train.sharding_plan(model_config, mesh, tc.fsdp)

    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    model_abs = abstract_model(model_config)
    params_abs, static = eqx.partition(model_abs, is_abstract)
    opt_abs = jax.eval_shape(optimizer.init, params_abs)
    param_sh = partitioning.shardings(plan.specs, mesh)
    opt_sh = partitioning.optimizer_shardings(optimizer, params_abs, param_sh, mesh)
    place = lambda tree, sh: jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
    seq_sharding = NamedSharding(mesh, train.batch_spec(model_config))
    seq_len = model_config.padded_seq_len(config.seq_len)  # as the trainer pads a length the ring does not tile
    batch_abs = Batch(
        *(jax.ShapeDtypeStruct((rows, seq_len), dt, sharding=seq_sharding)
          for dt in (jnp.int32, jnp.int32, jnp.float32, jnp.int32, jnp.int32))
    )
    grad_fn = train.make_grad_fn(model_config, mesh, plan=plan, loss_chunk=config.loss_chunk)
    # the ring's work lists as the trainer passes them: a jit argument sharded over the ring axis
    # (each device holds its q shard's rows), not a constant replicated on every device
    schedule = train.batch_ring_schedule(model_config, mesh, batch_abs)

    def step(params, opt_state, batch, schedule):
        grads, metrics = grad_fn(params, static, batch, None, schedule)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (jax.lax.with_sharding_constraint(params, param_sh),
                jax.lax.with_sharding_constraint(opt_state, opt_sh), metrics)

    compiled = aot.compile_report(step, place(params_abs, param_sh), place(opt_abs, opt_sh), batch_abs, schedule,
                                  donate_argnums=(0, 1))
    mesh_shape = dict(mesh.shape)
    opt_specs = jax.tree.map(lambda s: s.spec, opt_sh)
    leaves = lambda t: jax.tree.leaves(t, is_leaf=is_abstract)
    n_params = sum(int(np.prod(x.shape)) for x in leaves(params_abs))
    nbytes = lambda t: sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves(t))
    info = {"devices": devices.size, "data": data, "context": context, "rows": rows, "params": n_params,
            "compile_s": compiled.seconds, "device_kind": getattr(devices[0], "device_kind", "?"),
            "plan": partitioning.describe(plan),
            "param_bytes": partitioning.local_bytes(params_abs, plan.specs, mesh_shape),
            "opt_bytes": partitioning.local_bytes(opt_abs, opt_specs, mesh_shape),
            "replicated_state_bytes": nbytes(params_abs) + nbytes(opt_abs),
            "batch_bytes": 5 * 4 * rows * seq_len // devices.size, "padded_seq_len": seq_len,
            "schedule_bytes": schedule_bytes_per_device(schedule),
            "estimates": _estimates(config, model_config, params_abs, data, context, rows, plan.sharded)}
    return compiled, info


def _estimates(config, model_config, params_abs, data, context, rows, sharded) -> dict:
    """Analytic sizes (bytes per device) of the temporaries the compiler reports only as a total."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    c = model_config
    cdt = jnp.dtype(c.compute_dtype).itemsize
    tokens = max(rows // data, 1) * config.seq_len // context
    layer = sum(int(np.prod(x.shape[1:])) for x in jax.tree.leaves(params_abs.layers))
    hd = c.num_heads * c.head_dim
    kv = 2 * c.num_kv_heads * c.head_dim
    per_layer = {  # saved residuals per layer and token (elements), by remat policy
        "full": c.d_model,
        "save_attention": c.d_model + hd + c.num_heads * 4 / cdt,
        "save_dots": c.d_model + 2 * hd + kv + c.d_model + 3 * c.mlp_hidden + c.num_heads * 4 / cdt,
        "none": 4 * c.d_model + 3 * hd + kv + 4 * c.mlp_hidden + c.num_heads * 4 / cdt,
    }[c.remat]
    vocab_tokens = config.loss_chunk or tokens
    est = {
        "saved activations (layer inputs / named residuals x layers)": int(per_layer * cdt * tokens * c.num_layers),
        "logits of one loss chunk (fwd + bwd, float32)": 3 * 4 * vocab_tokens * c.vocab_size,
    }
    if sharded:
        est["gathered weights: 2 layers + their gradients (compute dtype)"] = 4 * layer * cdt
        emb = c.vocab_size * c.d_model * (1 if c.features.tie_embeddings else 2)
        est["gathered embedding + unembedding and gradients"] = 2 * emb * cdt
    return est


def report(config: Config, compiled, info, *, quiet: bool = False) -> tuple[bool, float]:
    """Print ``compiled`` (an ``aot.AotReport``) against the chip's HBM; (fits, total bytes)."""
    capacity = chip_capacity(config.topology)
    args, outs, alias, temp, code, total = (compiled.args, compiled.out, compiled.alias, compiled.temp,
                                            compiled.code, compiled.total)
    fits = total <= config.headroom * capacity
    if quiet:
        return fits, total
    gib = lambda x: f"{x / GiB:8.3f} GiB"
    padded = "" if info["padded_seq_len"] == config.seq_len else f" (padded to {info['padded_seq_len']})"
    print(f"topology {config.topology} ({info['device_kind']}, {info['devices']} devices): mesh data={info['data']} x "
          f"context={info['context']}; {info['params'] / 1e6:.1f} M params; batch {info['rows']} x {config.seq_len} "
          f"tokens{padded}; remat={config.remat}; loss_chunk={config.loss_chunk or 'off'}; "
          f"compiled in {info['compile_s']:.1f} s")
    print(info["plan"])
    print("per-device HBM:")
    print(f"  arguments    {gib(args)}   (params, optimiser state, batch shard, ring schedule)")
    print(f"    parameters        {gib(info['param_bytes'])}")
    print(f"    optimiser state   {gib(info['opt_bytes'])}")
    print(f"    batch shard       {gib(info['batch_bytes'])}")
    print(f"    ring schedule     {gib(info['schedule_bytes'])}   (this device's rows of the work lists)")
    per_device = info["replicated_state_bytes"] / info["devices"]
    print(f"    params + optimiser state = {(info['param_bytes'] + info['opt_bytes']) / per_device:.3f} x "
          f"(replicated bytes / devices = {per_device / GiB:.3f} GiB)")
    print(f"  outputs      {gib(outs)}   ({gib(alias).strip()} aliased to donated arguments)")
    print(f"  temporaries  {gib(temp)}   biggest contributors (analytic estimates; the compiler reports a total):")
    for name, value in sorted(info["estimates"].items(), key=lambda kv: -kv[1]):
        print(f"    {name:62s} {gib(value)}")
    print(f"    {'rest (attention work space, MLP intermediates, collectives buffers)':62s} "
          f"{gib(temp - sum(info['estimates'].values()))}")
    print(f"  code         {gib(code)}")
    print(f"  total        {gib(total)}   of {gib(capacity).strip()} per device "
          f"({100 * total / capacity:.1f}%; limit {100 * config.headroom:.0f}%)")
    print("FITS" if fits else "DOES NOT FIT: lower seq_len / batch, use --remat full, --loss-chunk, or more chips")
    return fits, total


def _is_oom(message: str) -> bool:
    return "Ran out of memory" in message or "RESOURCE_EXHAUSTED" in message


def attempt(config: Config):
    """(fits, total bytes or None, compiled, info, reason): one compile of ``config``."""
    try:
        compiled, info = compile_step(config)
    except Exception as e:  # the TPU compiler refuses programs that exceed HBM (or SMEM)
        reason = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
        if not _is_oom(str(e)) and "smem" not in str(e).lower() and "memory" not in str(e).lower():
            raise
        return False, None, None, None, reason
    fits, total = report(config, compiled, info, quiet=True)
    return fits, total, compiled, info, "" if fits else "over the HBM limit"


def _largest(fits, start: int, step: int, cap: int) -> tuple[int, bool]:
    """The largest multiple of ``step`` (>= ``step``) with ``fits``: doubling from ``start`` (halving when it
    does not fit), then bisecting; (0, False) when not even ``step`` fits; the flag: the search hit ``cap``."""
    s = max(step, start // step * step)
    lo = hi = None
    if fits(s):
        lo = s
        while 2 * lo <= cap and fits(2 * lo):
            lo *= 2
        hi = 2 * lo
    else:
        hi = s
        while hi > step:
            cand = max(step, hi // 2 // step * step)
            if fits(cand):
                lo = cand
                break
            hi = cand
    if lo is None:
        return 0, False
    while hi - lo > step and lo < cap:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, lo >= cap


def _search(config: Config, field: str, step: int, cap: int, what: str, cap_flag: str) -> int:
    """``_largest`` over ``config.<field>`` (each candidate one compile, printed), then the report at the
    largest value that fits; 0 when none does."""
    tried = {}

    def fits(value: int) -> bool:
        if value not in tried:
            ok, total, compiled, info, reason = attempt(dataclasses.replace(config, **{field: value}))
            tried[value] = (ok, compiled, info)
            used = f"{total / GiB:.3f} GiB" if total is not None else "-"
            print(f"  {field} {value:>9d}: {'fits' if ok else 'does not fit'} ({used}{'; ' + reason if reason else ''})",
                  flush=True)
        return tried[value][0]

    best, capped = _largest(fits, getattr(config, field), step, cap)
    if not best:
        print(f"nothing fits, not even {field}={step}")
        return 0
    more = f" (the search stops at {cap_flag}; more may fit)" if capped else ""
    print(f"{what}: {best}{more}")
    _, compiled, info = tried[best]
    report(dataclasses.replace(config, **{field: best}), compiled, info)
    return best


def find_max_seq_len(config: Config) -> int:
    """Double ``seq_len`` while the step fits, then bisect in multiples of the granularity."""
    _, context = _mesh_shape(config, aot.topology_devices(config.topology).size)
    g = granularity(config, context)
    print(f"searching the longest sequence on {config.topology} (granularity {g} tokens):", flush=True)
    return _search(config, "seq_len", g, config.max_search_len, "longest sequence that fits (tokens)",
                   "--max-search-len")


def find_max_layers(config: Config) -> int:
    """Double ``num_layers`` while the step fits at ``seq_len``, then bisect (one layer at a time)."""
    print(f"searching the most layers at seq_len {config.seq_len} on {config.topology}:", flush=True)
    return _search(config, "num_layers", 1, config.max_search_layers, "most layers that fit", "--max-search-layers")


def main(config: Config) -> int:
    try:
        aot.topology_devices(config.topology)
    except ValueError as e:  # one line naming the flag, not a traceback
        print(f"aot_preflight.py: error: --topology {config.topology!r} is not accepted: {e}", file=sys.stderr)
        return 2
    if config.find_max_seq_len and config.find_max_layers:
        print("aot_preflight.py: error: --find-max-seq-len and --find-max-layers search one at a time",
              file=sys.stderr)
        return 2
    if config.find_max_seq_len:
        return 0 if find_max_seq_len(config) else 1
    if config.find_max_layers:
        return 0 if find_max_layers(config) else 1
    try:
        compiled, info = compile_step(config)
    except Exception as e:  # the TPU compiler itself refuses programs that exceed HBM
        message = str(e)
        if not _is_oom(message):
            raise
        print(f"topology {config.topology}: the compiler reports the step exceeds HBM "
              f"({chip_capacity(config.topology) / GiB:.3f} GiB per device):")
        print("  " + message.strip().splitlines()[-1][:500])
        print("DOES NOT FIT: lower seq_len / batch, use --remat full, --loss-chunk, or more chips")
        return 1
    return 0 if report(config, compiled, info)[0] else 1


if __name__ == "__main__":
    sys.exit(run_script(main, parse_args))
