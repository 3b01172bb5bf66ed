"""ContextParallel (the strategy and its rules, one nested value of TransformerConfig), ModelFeatures,
and the previous release's flat spellings (deprecated, still working for one release)."""

import dataclasses
import json
import warnings

import pytest

from ringsplash import train
from ringsplash.model import ContextParallel, ModelFeatures, TransformerConfig
from ringsplash.model.attention import LOCAL_ATTENTION
from ringsplash.model.parallelism import RULES, STRATEGIES
from ringsplash.splash import SplashConfig

SMALL = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
BASE = dict(vocab_size=32, d_model=64, num_layers=2, num_heads=4, max_seq_len=1024, splash=SMALL)


def test_transformer_config_has_at_most_25_fields():
    assert len(dataclasses.fields(TransformerConfig)) <= 25


def test_every_strategy_has_a_rule_and_a_local_attention():
    assert set(RULES) == set(LOCAL_ATTENTION) == set(STRATEGIES)


@pytest.mark.parametrize("strategy, axes", [("reference", {}), ("splash", {}), ("ring", {"context": 4}),
                                            ("allgather", {"context": 4}), ("ulysses", {"context": 4}),
                                            ("usp", {"context": 2, "ulysses": 2})])
def test_default_axes_are_the_trainers(strategy, axes):
    sizes = {"usp": dict(ring_size=2, ulysses_size=2), "ulysses": dict(ulysses_size=4)}.get(
        strategy, dict(ring_size=4) if axes else {})
    cp = ContextParallel(strategy, **sizes)
    assert cp.axes() == axes and cp.shards == (4 if axes else 1)
    assert hash(cp) == hash(ContextParallel(strategy, **sizes))


def test_changes_of_strategy():
    ring = ContextParallel("ring", ring_size=4, layout="striped")
    one = ring.single_device()
    assert one == ContextParallel("splash", layout="striped") and one.axes() == {}
    assert ring.single_device("reference").strategy == "reference"
    assert ContextParallel("reference").single_device() == ContextParallel("reference")
    gather = ring.on_axis("seq", 8)
    assert (gather.strategy, gather.ring_axis, gather.ring_size, gather.layout) == ("allgather", "seq", 8, "striped")
    uly = one.on_axis(None, 2, "ulysses", layout="contiguous")
    assert uly.axes() == {"context": 2} and uly.layout == "contiguous"
    with pytest.raises(ValueError, match=r"single_device\(strategy='ring'\): expected one of"):
        ring.single_device("ring")
    with pytest.raises(ValueError, match=r"on_axis\(strategy='usp'\): expected a one-axis strategy"):
        ring.on_axis(None, 4, "usp")


def test_unused_axes_are_dropped():
    # an axis the strategy does not use is None, so equal parallelisms compare (and hash) equal
    assert ContextParallel("reference", ring_axis="context") == ContextParallel("reference")


def test_length_rule_lives_on_context_parallel():
    config = TransformerConfig(**BASE, context_parallel=ContextParallel("ring", ring_size=4))
    with pytest.raises(ValueError, match="must be divisible by ring_size x ulysses_size"):
        config.context_parallel.check_seq_len(1030, SMALL)
    assert config.padded_seq_len(1001) == 1008  # the next length 4 zigzag shards split (8 chunks of 126)


def test_mesh_comes_from_the_model_config():
    config = TransformerConfig(**BASE, context_parallel=ContextParallel("ring", ring_size=4))
    mesh = train.mesh_for(config, 2)
    assert dict(mesh.shape) == {"data": 2, "context": 4}
    train.check_mesh(config, mesh)
    other = config.replace(context_parallel=ContextParallel("ring", ring_axis="seq", ring_size=4))
    with pytest.raises(ValueError, match="leave ring_axis / ulysses_axis at their defaults"):
        train.mesh_for(other)
    with pytest.raises(ValueError, match="does not shard over it"):
        train.check_mesh(config.replace(context_parallel=ContextParallel("splash")), mesh)


# ------------------------------------------------------------------ the previous release's spellings


def test_old_flat_keywords_still_build_the_nested_config():
    new = TransformerConfig(**BASE, context_parallel=ContextParallel("ring", ring_size=4, layout="striped"),
                            features=ModelFeatures(qk_norm=True, sliding_window=None))
    with pytest.warns(DeprecationWarning, match=r"ring_size -> context_parallel.ring_size.*qk_norm -> features.qk_norm"):
        old = TransformerConfig(**BASE, attention="ring", ring_axis_name="context", ring_size=4, ring_layout="striped",
                                qk_norm=True)
    assert old == new


def test_old_attribute_reads_and_replace_warn_and_work():
    config = TransformerConfig(**BASE, context_parallel=ContextParallel("ring", ring_size=4))
    with pytest.warns(DeprecationWarning, match=r"read config.context_parallel.ring_size"):
        assert config.ring_size == 4
    with pytest.warns(DeprecationWarning, match=r"read config.context_parallel.strategy"):
        assert config.attention == "ring"
    with pytest.warns(DeprecationWarning, match=r"read config.features.tie_embeddings"):
        assert config.tie_embeddings is False
    with pytest.warns(DeprecationWarning, match=r"ring_size -> context_parallel.ring_size"):
        smaller = config.replace(ring_size=2)
    assert smaller.context_parallel == ContextParallel("ring", ring_size=2)
    with pytest.warns(DeprecationWarning):
        assert dataclasses.replace(config, tie_embeddings=True).features.tie_embeddings
    with pytest.raises(AttributeError, match="no attribute 'ring_sise'"):
        config.ring_sise  # noqa: B018


def test_new_spellings_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        config = TransformerConfig(**BASE, context_parallel=ContextParallel("ring", ring_size=4))
        config = config.replace(max_seq_len=2048, features=config.features.replace(qk_norm=True))
        TransformerConfig.from_dict(json.loads(json.dumps(config.to_dict())))
        assert config.context_parallel.ring_size == 4 and config.strategy == "ring"


def test_old_flat_config_dicts_still_load():
    """Checkpoints and run directories written before hold the flat form: read silently."""
    config = TransformerConfig(**BASE, context_parallel=ContextParallel("usp", ring_size=2, ulysses_size=2),
                               features=ModelFeatures(eos_token_id=(1, 2), tie_embeddings=True))
    d = json.loads(json.dumps(config.to_dict()))
    flat = {k: v for k, v in d.items() if k not in ("context_parallel", "features")}
    flat.update(attention="usp", ring_axis_name="context", ring_size=2, ulysses_axis_name="ulysses", ulysses_size=2,
                ring_layout="zigzag", **d["features"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert TransformerConfig.from_dict(flat) == config
    assert train.upgrade_run_config({"model": flat, "train": {"context_parallel": 4, "steps": 3}}) == {
        "model": d, "train": {"steps": 3}}


def test_old_train_config_fields_warn_and_are_ignored():
    with pytest.warns(DeprecationWarning, match="TransformerConfig.context_parallel"):
        tc = train.TrainConfig(steps=100, context_parallel=4, ulysses_parallel=2)
    assert tc == train.TrainConfig(steps=100)
    assert train.TrainConfig.from_dict({"steps": 100, "context_parallel": 4}) == tc
