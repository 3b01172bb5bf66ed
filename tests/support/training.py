"""A tiny training set-up (model config, train config, data stream) on the recall task."""

from ringsplash import data, train
from ringsplash.model import TransformerConfig
from ringsplash.splash import SplashConfig

BLOCKS = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
TASK = data.RecallTask(seq_len=128, num_pairs=8, num_queries=8, num_keys=16, num_values=8, num_filler=8)


def setup(seq=128, steps=12, **model_kw):
    config = TransformerConfig(**{**dict(vocab_size=TASK.vocab_size, d_model=32, num_layers=2, num_heads=2,
                                         max_seq_len=seq, splash=BLOCKS), **model_kw})
    tc = train.TrainConfig(steps=steps, batch_size=4, learning_rate=3e-3, warmup_steps=2, log_every=2, progress=False)
    task = TASK if seq == TASK.seq_len else TASK.__class__(**{**TASK.__dict__, "seq_len": seq})
    stream = data.DataStream(make=lambda rng, n, step: task.batch(rng, n), batch_size=4, seed=3)
    return config, tc, stream
