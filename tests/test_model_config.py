"""TransformerConfig: every rejected combination raises a ValueError naming the option and the fix."""

import inspect

import pytest

from ringsplash import masks
from ringsplash.model import ContextParallel, TransformerConfig
from ringsplash.splash import SplashConfig
from support.errors import assert_refused

SMALL = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
BASE = dict(vocab_size=32, d_model=64, num_layers=2, num_heads=4, max_seq_len=1024, splash=SMALL)


def make(**changes):
    return TransformerConfig(**{**BASE, **changes})


REJECTED = [
    # (changes, fragments the message must contain)
    (dict(context_parallel=ContextParallel("splash"), attention_dropout=0.1),
     ["attention_dropout=0.1", "not supported by the splash/ring kernels", "ContextParallel('reference')",
      "attention_dropout=0"]),
    (dict(context_parallel=ContextParallel("ring", ring_size=4), attention_dropout=0.2),
     ["not supported by the splash/ring kernels", "ContextParallel('reference') or attention_dropout=0"]),
    (dict(num_heads=4, num_kv_heads=3), ["num_heads=4 must be divisible by num_kv_heads=3", "num_kv_heads"]),
    # the ring shrinks blocks to its shards; a length it cannot tile is padded by the trainer
    # (tests/test_context_parallel_lengths.py), except under a fixed-shape Mask, which serves its own
    # length only: a shard the ring cannot tile then names the config / S that would
    (dict(context_parallel=ContextParallel("ring", ring_size=4), max_seq_len=8 * 200,
          mask=masks.CausalMask((1600, 1600))),
     ["S // 8 = 1600 // 8 = 200 tokens per zigzag half-shard", "cannot tile the 200-token zigzag half-shard",
      "S=2048"]),
    (dict(context_parallel=ContextParallel("ring", ring_size=4, layout="contiguous"), max_seq_len=4 * 200,
          mask=masks.CausalMask((800, 800))),
     ["S // 4 = 800 // 4 = 200 tokens per shard", "SplashConfig(block_q=256", "S=1024"]),
    (dict(mask="local"), ["mask='local' needs local_window"]),
    (dict(mask="chunked", chunk_size=0), ["mask='chunked' needs chunk_size"]),
    (dict(mask="prefix_lm"), ["mask='prefix_lm' needs prefix_len"]),
    (dict(mask="causal", local_window=8), ["local_window=8 only applies to mask='local'", "local_window=None"]),
    (dict(mask="prefix_lm", prefix_len=2048), ["prefix_len=2048 must be <= max_seq_len=1024"]),
    (dict(attention_dropout=1.0), ["attention_dropout must be in [0, 1)"]),
    (dict(num_heads=3), ["head_dim=None needs num_heads=3 to divide d_model=64", "head_dim"]),
    (dict(head_dim=15), ["head_dim=15 must be even"]),
    (dict(vocab_size=0), ["vocab_size must be a positive int"]),
    (dict(num_layers=-1), ["num_layers must be a positive int"]),
    (dict(logit_soft_cap=-1.0), ["logit_soft_cap must be > 0, got logit_soft_cap=-1.0"]),
    (dict(mlp_ratio=-1.0), ["mlp_ratio must be > 0, got mlp_ratio=-1.0"]),
]


@pytest.mark.parametrize("changes, fragments", REJECTED, ids=[str(c) for c, _ in REJECTED])
def test_config_rejects_with_message(changes, fragments):
    assert_refused(ValueError, lambda: make(**changes), fragments)


# Literal-typed mode strings: rejected by the config's own check (ValueError) or, first, by the
# test run's jaxtyping/beartype check of the Literal annotation (TypeError); both name the field and value.
LITERAL_REJECTED = [
    (dict(mask="sliding"), "mask", "sliding"),
    (dict(param_dtype="float64"), "param_dtype", "float64"),
    (dict(compute_dtype="int8"), "compute_dtype", "int8"),
]


@pytest.mark.parametrize("changes, field, value", LITERAL_REJECTED, ids=[f for _, f, _ in LITERAL_REJECTED])
def test_config_rejects_unknown_mode_string(changes, field, value):
    with pytest.raises((ValueError, TypeError)) as info:
        make(**changes)
    assert field in str(info.value) and repr(value) in str(info.value), str(info.value)


# ContextParallel: its own checks name the field (ContextParallel.<field>) and what was given
CONTEXT_PARALLEL_REJECTED = [
    (dict(ring_size=2), ["ContextParallel.ring_size=2 needs strategy in", "strategy='splash'", "ring_size=1"]),
    (dict(strategy="ring", ring_size=0), ["ContextParallel.ring_size must be a positive int"]),
    (dict(strategy="ulysses", ring_size=2, ulysses_size=2), ["ContextParallel.ring_size=2 needs strategy in"]),
    (dict(strategy="usp", ring_axis="x", ulysses_axis="x"), ["strategy='usp' needs two different mesh axes"]),
]


@pytest.mark.parametrize("kwargs, fragments", CONTEXT_PARALLEL_REJECTED, ids=[str(k) for k, _ in CONTEXT_PARALLEL_REJECTED])
def test_context_parallel_rejects_with_message(kwargs, fragments):
    assert_refused((ValueError, TypeError), lambda: ContextParallel(**kwargs), fragments)


@pytest.mark.parametrize("field, value", [("strategy", "rnig"), ("layout", "spiral")])
def test_context_parallel_rejects_unknown_mode_string(field, value):
    """Outside the tests' annotation checks (as in library use) __post_init__ names the field and value."""
    cp = ContextParallel("ring")
    object.__setattr__(cp, field, value)
    with pytest.raises(ValueError, match=rf"ContextParallel\.{field} must be one of .*got ContextParallel\.{field}='{value}'"):
        cp.__post_init__()


@pytest.mark.parametrize(
    "changes",
    [
        dict(),
        dict(context_parallel=ContextParallel("splash")),
        dict(context_parallel=ContextParallel("ring", ring_size=4)),
        dict(context_parallel=ContextParallel("ring", ring_size=8, layout="striped")),
        dict(context_parallel=ContextParallel("reference"), attention_dropout=0.1),
        dict(mask="local", local_window=16),
        dict(mask="chunked", chunk_size=64),
        dict(mask="prefix_lm", prefix_len=100),
        dict(mask="full"),
        dict(num_kv_heads=1, sinks=True, logit_soft_cap=30.0, remat="save_dots", param_dtype="bfloat16"),
        dict(context_parallel=ContextParallel("splash"), d_model=512, num_heads=4, splash=SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="mosaic_tpu")),
        # head sizes other than 128 on the TPU kernels (compiled for v5e: tests/test_head_dims_tpu_compile.py)
        dict(context_parallel=ContextParallel("splash"), d_model=256, num_heads=4, splash=SplashConfig(backend="mosaic_tpu", block_q=128,
                                                                              block_kv=128, block_q_dkv=128,
                                                                              block_kv_dkv=128)),
        dict(context_parallel=ContextParallel("ring", ring_size=4), head_dim=96,
             splash=SplashConfig(backend="mosaic_tpu")),
    ],
)
def test_config_accepts_valid(changes):
    c = make(**changes)
    assert c.num_kv_heads >= 1 and c.head_dim * c.num_heads >= 1
    assert TransformerConfig.from_dict(c.to_dict()) == c or c.splash.interpret_params is not None
    assert hash(c) == hash(make(**changes))  # static module field: must hash


def test_config_is_frozen():
    c = make()
    with pytest.raises(AttributeError):
        c.d_model = 8


def test_config_mask_shapes():
    for mask, extra in (("causal", {}), ("local", {"local_window": 4}), ("chunked", {"chunk_size": 8}),
                        ("prefix_lm", {"prefix_len": 3}), ("full", {})):
        m = make(mask=mask, **extra).make_mask(32)
        assert m.shape == (32, 32)


def test_default_config_attends_with_splash_and_compiles_at_32k():
    """A plain TransformerConfig is a long-context model: its default strategy is "splash" (block-sparse, the
    xla backend on CPU), so a 32K forward holds no S x S scores (the dense reference's would be 4 GiB)."""
    import jax
    import jax.numpy as jnp

    from ringsplash.model import Transformer

    config = TransformerConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=1, max_seq_len=32768)
    assert config.context_parallel == ContextParallel("splash")
    model = jax.eval_shape(lambda: Transformer(config, key=jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((32768,), jnp.int32)
    compiled = jax.jit(lambda m, t: m(t, jnp.arange(32768))).lower(model, tokens).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 2**30


def test_make_mask_and_rope_for_name_an_unknown_layer_type():
    """An unknown layer_type gave the model's own mask / RoPE silently; "sliding_attention" on a config without
    a sliding window was a TypeError inside LocalMask. Both are refused naming layer_type."""
    config = TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, max_seq_len=128)
    for call in (lambda: config.make_mask(128, "sliding"), lambda: config.rope_for("full")):
        with pytest.raises(ValueError, match=r"layer_type must be one of \(None, 'full_attention', "
                                             r"'sliding_attention'\), got layer_type="):
            call()
    with pytest.raises(ValueError, match=r"layer_type='sliding_attention' needs features.sliding_window"):
        config.make_mask(128, "sliding_attention")
    assert config.make_mask(128, "full_attention") == config.make_mask(128)
    assert config.rope_for(None) == config.rope_for("full_attention")


def test_from_dict_refuses_what_is_not_a_dict_naming_it():
    """from_dict(None) was "'NoneType' object is not iterable"; a list a dict-update error."""
    from_dict = inspect.unwrap(TransformerConfig.from_dict.__func__)  # past the call-time type check
    for bad in (None, [1, 2]):
        with pytest.raises(TypeError, match=r"d must be a dict \(TransformerConfig.to_dict\(\)'s\), got "):
            from_dict(TransformerConfig, bad)
    config = TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, max_seq_len=128)
    assert from_dict(TransformerConfig, config.to_dict()) == config
