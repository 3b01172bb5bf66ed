"""One model, one batch, every attention strategy: do they compute the same function?

Runs the same parameters on the same batch (two packed documents per row, GQA, sinks,
logit soft-cap) under ``reference`` (dense oracle), ``splash`` (block-sparse, one device) and
``ring`` over N = 2, 4, 8 simulated devices (tokens laid out once by the ring layout; logits
mapped back to original order), through the trainer's own sharded gradient function, and
prints the max abs difference of logits and of gradients against the reference.

    python experiments/strategy_equivalence.py
    python experiments/strategy_equivalence.py --layout striped --ring-sizes 2,4
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
    seq_len: int = 2048
    ring_sizes: str = "2,4,8"
    layout: str = "zigzag"
    backend: str = "xla"
    block: int = 128
    vocab_size: int = 64
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    batch_size: int = 2
    seed: int = 0


def parse_args(argv=None) -> Config:
    return parse_config(Config, argv, description=__doc__)


def main(config: Config) -> list[dict]:
    import jax

    sizes = [int(n) for n in config.ring_sizes.split(",") if n]
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", max(sizes + [1]))
    import equinox as eqx
    import numpy as np

    from ringsplash import data, layouts, train
    from ringsplash.model import Transformer, TransformerConfig
    from ringsplash.splash import SplashConfig

    S, b = config.seq_len, config.block
    base = TransformerConfig(
        vocab_size=config.vocab_size, d_model=config.d_model, num_layers=config.num_layers,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, max_seq_len=S, sinks=True, logit_soft_cap=30.0,
        splash=SplashConfig(block_q=b, block_kv=b, block_q_dkv=b, block_kv_dkv=b, backend=config.backend),
    )
    model = Transformer(base, key=jax.random.key(config.seed))
    rng = np.random.default_rng(config.seed)
    tokens = rng.integers(0, config.vocab_size, (config.batch_size, S), dtype=np.int32)
    docs = [tokens[i] for i in range(config.batch_size)]
    cut = [rng.integers(S // 4, 3 * S // 4) for _ in docs]
    batch = data.pack_documents([x for d, c in zip(docs, cut) for x in (d[:c], d[c:])], S, config.batch_size)

    def run(cfg):
        n = cfg.ring_size
        mesh = train.make_mesh(1, n)
        m = model.with_config(cfg)
        params, static = eqx.partition(m, eqx.is_array)
        params = train.replicate(params, mesh)
        sharded = train.shard_batch(batch, mesh, cfg)
        t0 = time.perf_counter()
        logits = np.asarray(train.make_logits_fn(cfg, mesh)(eqx.combine(params, static), sharded))
        grads, metrics = jax.jit(lambda p, bb: train.make_grad_fn(cfg, mesh)(p, static, bb))(params, sharded)
        grads = jax.device_get(grads)
        if cfg.attention == "ring":
            logits = layouts.unpermute(logits, cfg.ring_layout, n, axis=1)
        return logits, grads, float(metrics["loss"]), time.perf_counter() - t0

    ref_logits, ref_grads, ref_loss, t = run(base)
    rows = [dict(strategy="reference", n=1, logits=0.0, grads=0.0, loss=ref_loss, seconds=t)]
    configs = [("splash", base.replace(attention="splash"))]
    for n in sizes:
        configs.append((f"ring/{config.layout}", base.replace(
            attention="ring", ring_axis_name="context", ring_size=n, ring_layout=config.layout)))
    for name, cfg in configs:
        logits, grads, loss, t = run(cfg)
        gdiff = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                    for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True))
        rows.append(dict(strategy=name, n=cfg.ring_size, logits=float(np.max(np.abs(logits - ref_logits))),
                         grads=gdiff, loss=loss, seconds=t))
    gmax = max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(ref_grads))
    print(f"seq_len={S}, batch={config.batch_size} (2 packed documents per row), heads={config.num_heads}/"
          f"{config.num_kv_heads} kv, sinks + soft-cap, backend={config.backend}, block={b}")
    print(f"max |logit| = {np.max(np.abs(ref_logits)):.3g}, max |grad| = {gmax:.3g}")
    print(f"{'strategy':<16}{'N':>3}  {'max|Δlogits|':>13}  {'max|Δgrads|':>12}  {'loss':>9}  "
          f"{'s (CPU, compile incl.)':>22}")
    for r in rows:
        print(f"{r['strategy']:<16}{r['n']:>3}  {r['logits']:>13.2e}  {r['grads']:>12.2e}  {r['loss']:>9.5f}  "
              f"{r['seconds']:>22.1f}")
    return rows


if __name__ == "__main__":
    main(parse_args())
