"""``model.abstract_model``: the one abstract Transformer every restore target, sharding plan and
cache structure starts from."""

import equinox as eqx
import jax

from ringsplash.model import Transformer, TransformerConfig, abstract_model


def test_abstract_model_has_the_models_structure_shapes_and_dtypes_and_allocates_nothing():
    config = TransformerConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, max_seq_len=64)
    real = eqx.filter(Transformer(config, key=jax.random.key(3)), eqx.is_array)
    abstract = eqx.filter(abstract_model(config), lambda x: isinstance(x, jax.ShapeDtypeStruct))
    assert jax.tree.structure(real) == jax.tree.structure(abstract)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(real)] == [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)]
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
