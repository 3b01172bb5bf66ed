"""One model, one batch, every attention strategy: do they compute the same function?

Runs the same parameters on the same batch (two packed documents per row, GQA, sinks,
logit soft-cap) under ``reference`` (dense oracle), ``splash`` (block-sparse, one device) and,
over N = 2, 4, 8 simulated devices, ``ring``, ``allgather``, ``ulysses`` (when the heads split
over N) and ``usp`` (every (ulysses, ring) factorisation of N with both degrees > 1 that the
heads allow), with tokens laid out once by the strategy's layout and logits mapped back to
original order, through the trainer's own mesh (``train.mesh_for``) and sharded gradient
function; prints the max abs difference of logits and of gradients against the reference.

    python experiments/strategy_equivalence.py
    python experiments/strategy_equivalence.py --layout striped --ring-sizes 2,4 --strategies ring,usp
    python experiments/strategy_equivalence.py --preset 1b --num-layers 1 --seq-len 1024 --ring-sizes 4
"""

import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
import contextlib

from ringsplash.cli import parse_config


@dataclasses.dataclass(frozen=True)
class Config:
    seq_len: int = 2048  # tokens per row
    ring_sizes: str = "2,4,8"  # N: devices the sequence is sharded over (comma-separated, one run each)
    strategies: str = "ring,allgather,ulysses,usp"  # the sequence-parallel ones (reference, splash always run)
    layout: str = "zigzag"  # token layout over the N devices: contiguous | zigzag | striped
    backend: str = "xla"  # Splash backend: auto | mosaic_tpu | interpret | xla
    block: int = 128  # Splash block size (tokens), every block of the kernels
    # model (--preset NAME takes a ringsplash.model.presets shape; any field still overridable)
    preset: str = ""  # a ringsplash.model.presets name; "" = the model fields below
    vocab_size: int = 64  # token vocabulary (random tokens)
    d_model: int = 64  # model width
    num_layers: int = 2  # transformer layers
    num_heads: int = 8  # query heads
    num_kv_heads: int = 2  # key/value heads (GQA: divides num_heads)
    head_dim: int = 0  # 0 = auto: d_model // num_heads
    mlp_ratio: float = 8 / 3  # SwiGLU hidden width / d_model (rounded up to mlp_multiple)
    mlp_multiple: int = 8  # the SwiGLU hidden width is a multiple of this
    rope_theta: float = 10_000.0  # RoPE base frequency
    batch_size: int = 2  # rows (two packed documents each)
    seed: int = 0  # seed of the parameters and the tokens

    def __post_init__(self):
        """Option strings checked at once, each error naming its flag (the library configs check the rest)."""
        from ringsplash.cli import check_flags, flag_error
        from ringsplash.layouts import LAYOUTS
        from ringsplash.splash.config import BACKENDS

        check_flags(self, choices={"layout": LAYOUTS, "backend": BACKENDS},
                    positive=("seq_len", "block", "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                              "mlp_multiple", "batch_size"),
                    non_negative=("head_dim", "seed"), positive_numbers=("mlp_ratio", "rope_theta"))
        sizes = self.ring_sizes.split(",")
        if not all(n.isdigit() and int(n) >= 1 for n in sizes):
            raise flag_error("ring_sizes", self.ring_sizes, "comma-separated device counts >= 1 (e.g. 2,4,8)")
        known = ("ring", "allgather", "ulysses", "usp")
        if not set(self.strategies.split(",")) <= set(known):
            raise flag_error("strategies", self.strategies, f"a comma-separated subset of {','.join(known)}")


def parse_args(argv=None) -> Config:
    from ringsplash.model.presets import PRESETS

    return parse_config(Config, argv, description=__doc__, presets=PRESETS)


def strategy_configs(base, strategies, n: int, layout: str) -> list[tuple[str, object]]:
    """(label, model config or the reason it cannot run) for each sequence-parallel strategy on N devices."""
    from ringsplash.model import ContextParallel
    from ringsplash.parallel.heads import usp_factorisations, valid_ulysses_degrees

    h, kv = base.num_heads, base.num_kv_heads
    cp = base.context_parallel
    out = []
    for name in strategies:
        if name in ("ring", "allgather"):
            out.append((f"{name}/{layout}", base.replace(context_parallel=cp.on_axis(None, n, name, layout=layout))))
        elif name == "ulysses":
            ok = n in valid_ulysses_degrees(h, kv)
            out.append((f"ulysses/{layout}", base.replace(context_parallel=cp.on_axis(None, n, name, layout=layout))
                        if ok else f"heads {h}/{kv} kv cannot split over {n}"))
        elif name == "usp":
            for a, b in usp_factorisations(n, h, kv):
                if 1 < a < n:
                    usp = ContextParallel("usp", ring_size=b, ulysses_size=a, layout=layout)
                    out.append((f"usp {a}x{b}/{layout}", base.replace(context_parallel=usp)))
        else:
            raise ValueError(f"unknown strategy {name!r} in --strategies: choose among ring, allgather, ulysses, usp")
    return out


def main(config: Config) -> list[dict]:
    import jax

    sizes = [int(n) for n in config.ring_sizes.split(",") if n]
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", max(sizes + [1]))
    import equinox as eqx
    import numpy as np

    from ringsplash import data, train
    from ringsplash.model import ContextParallel, Transformer, TransformerConfig
    from ringsplash.splash import SplashConfig

    S, b = config.seq_len, config.block
    base = TransformerConfig(
        vocab_size=config.vocab_size, d_model=config.d_model, num_layers=config.num_layers,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim or None,
        mlp_ratio=config.mlp_ratio, mlp_multiple=config.mlp_multiple, rope_theta=config.rope_theta,
        max_seq_len=S, sinks=True, logit_soft_cap=30.0, context_parallel=ContextParallel("reference"),  # the oracle
        splash=SplashConfig(block_q=b, block_kv=b, block_q_dkv=b, block_kv_dkv=b, backend=config.backend),
    )
    model = Transformer(base, key=jax.random.key(config.seed))
    rng = np.random.default_rng(config.seed)
    tokens = rng.integers(0, config.vocab_size, (config.batch_size, S), dtype=np.int32)
    docs = [tokens[i] for i in range(config.batch_size)]
    cut = [rng.integers(S // 4, 3 * S // 4) for _ in docs]
    batch = data.pack_documents([x for d, c in zip(docs, cut) for x in (d[:c], d[c:])], S, config.batch_size)

    def run(cfg):
        mesh = train.mesh_for(cfg)
        m = model.with_config(cfg)
        params, static = eqx.partition(m, eqx.is_array)
        params = train.replicate(params, mesh)
        sharded = train.shard_batch(batch, mesh, cfg)
        t0 = time.perf_counter()
        logits = np.asarray(train.make_logits_fn(cfg, mesh)(eqx.combine(params, static), sharded))
        grads, metrics = jax.jit(lambda p, bb: train.make_grad_fn(cfg, mesh)(p, static, bb))(params, sharded)
        grads = jax.device_get(grads)
        logits = train.unlayout(logits, cfg, S)
        return logits, grads, float(metrics["loss"]), time.perf_counter() - t0

    ref_logits, ref_grads, ref_loss, t = run(base)
    rows = [dict(strategy="reference", n=1, logits=0.0, grads=0.0, loss=ref_loss, seconds=t)]
    configs = [("splash", base.replace(context_parallel=base.context_parallel.single_device("splash")))]
    for n in sizes:
        configs += strategy_configs(base, [x for x in config.strategies.split(",") if x], n, config.layout)
    for name, cfg in configs:
        if isinstance(cfg, str):  # a strategy the heads do not allow at this N
            rows.append(dict(strategy=name, n=0, skipped=cfg))
            continue
        logits, grads, loss, t = run(cfg)
        gdiff = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                    for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True))
        rows.append(dict(strategy=name, n=cfg.context_shards, logits=float(np.max(np.abs(logits - ref_logits))),
                         grads=gdiff, loss=loss, seconds=t))
    gmax = max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(ref_grads))
    print(f"seq_len={S}, batch={config.batch_size} (2 packed documents per row), heads={config.num_heads}/"
          f"{config.num_kv_heads} kv, sinks + soft-cap, backend={config.backend}, block={b}")
    print(f"max |logit| = {np.max(np.abs(ref_logits)):.3g}, max |grad| = {gmax:.3g}")
    print(f"{'strategy':<22}{'N':>3}  {'max|Δlogits|':>13}  {'max|Δgrads|':>12}  {'loss':>9}  "
          f"{'s (CPU, compile incl.)':>22}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['strategy']:<22}  -  n/a: {r['skipped']}")
            continue
        print(f"{r['strategy']:<22}{r['n']:>3}  {r['logits']:>13.2e}  {r['grads']:>12.2e}  {r['loss']:>9.5f}  "
              f"{r['seconds']:>22.1f}")
    return rows


if __name__ == "__main__":
    from ringsplash.cli import run_script

    run_script(main, parse_args)
