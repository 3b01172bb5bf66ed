"""``ringsplash.hf.families``: every Hugging Face family is one ``Family`` record that both directions
read (config.json → ``TransformerConfig`` → config.json), and adding a family is adding a record.
No torch or transformers here (``tests/test_hf.py`` compares with them)."""

import pytest

import ringsplash.hf as rhf
from ringsplash.hf import families
from ringsplash.hf.family import FEATURE_FIELDS, Family
from ringsplash.hf.features import Activation, Key
from ringsplash.hf.names import LAYER
from ringsplash.model import TransformerConfig

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5)
#: per family, config.json dicts that exercise its features (the defaults, then each option set)
CONFIGS = {
    "llama": [{}, dict(head_dim=32, tie_word_embeddings=True, bos_token_id=5, eos_token_id=[7, 9], pad_token_id=3),
              dict(rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=128))],
    "mistral": [{}, dict(sliding_window=128), dict(sliding_window=None)],
    "qwen2": [{}, dict(use_sliding_window=True, sliding_window=128, max_window_layers=1),
              dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024))],
    "qwen3": [dict(head_dim=32), dict(layer_types=["full_attention", "sliding_attention"] * 2,
                                      use_sliding_window=True, sliding_window=64)],
    "gemma2": [dict(head_dim=16), dict(head_dim=16, sliding_window=128, query_pre_attn_scalar=24,
                                       attn_logit_softcapping=5.0, final_logit_softcapping=3.0)],
    "gemma3_text": [dict(head_dim=16), dict(head_dim=16, sliding_window_pattern=2, rope_scaling=dict(
        rope_type="dynamic", factor=2.0)), dict(head_dim=16, layer_types=["sliding_attention", "full_attention"] * 2,
                                                rope_parameters=dict(
        full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
        sliding_attention=dict(rope_type="default", rope_theta=1e4)))],
}
CASES = [(t, i) for t, ds in CONFIGS.items() for i in range(len(ds))]


def test_every_supported_model_type_is_one_record_in_one_table():
    assert set(CONFIGS) == set(rhf.SUPPORTED_MODEL_TYPES) == set(rhf.FAMILIES)
    for model_type, family in rhf.FAMILIES.items():
        assert isinstance(family, Family) and family.model_type == model_type
        owned = {f for feature in family.features for f in feature.fields}
        assert set(family.fixed) <= set(FEATURE_FIELDS), model_type  # the rest is common to every family
        assert not owned & set(family.fixed), model_type


@pytest.mark.parametrize("model_type, i", CASES)
def test_registry_round_trips_every_family_config_both_ways(model_type, i):
    """config.json → TransformerConfig → config.json → the same TransformerConfig, as the same family,
    and the written config.json says what the read one said."""
    d = dict(TINY, model_type=model_type, **CONFIGS[model_type][i])
    c = rhf.config_from_hf(d)
    causal_mistral = model_type == "mistral" and c.mask == "causal"  # a Llama: transformers runs both alike
    assert families.infer_model_type(c) == ("llama" if causal_mistral else model_type)
    written = rhf.hf_config_dict(c, model_type)
    assert written["model_type"] == model_type
    assert written["architectures"] == [rhf.FAMILIES[model_type].architecture]
    assert rhf.config_from_hf(written) == c
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps",
                "sliding_window", "layer_types", "query_pre_attn_scalar", "final_logit_softcapping"):
        if d.get(key) is not None and (key != "sliding_window" or model_type == "mistral" or c.features.layer_types):
            assert written[key] == d[key], key


def test_to_hf_names_everything_a_family_cannot_express():
    c = TransformerConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=2)
    with pytest.raises(ValueError, match=r"as model_type='gemma2': .*norm_offset=0.0 \(the family has 1.0\).*"
                                         r"mlp_activation='silu' \(the family has 'gelu_tanh'\)"):
        rhf.hf_config_dict(c, "gemma2")
    with pytest.raises(ValueError, match=r"as model_type='qwen2': attention_bias=False \(the family has True\)"):
        rhf.hf_config_dict(c, "qwen2")
    assert families.infer_model_type(c.replace(mask="local", local_window=7)) == "mistral"
    assert families.infer_model_type(c.replace(features=c.features.replace(attention_bias=True))) == "qwen2"


def test_a_new_family_is_one_record(monkeypatch):
    """A made-up family, a Llama with q/k norms and a soft-capped head under other tensor names, works
    in both directions once its record is in the table; nothing else changes."""
    toy = Family("toy", "ToyForCausalLM", dict(max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e4),
                 fixed=dict(qk_norm=True), norms={"layers.mlp_norm.weight": LAYER + "pre_mlp_norm.weight"},
                 features=(Activation("silu", keys=("hidden_act",), accepted=("silu",), what="SwiGLU"),
                           Key("final_logit_soft_cap", "logit_cap")))
    monkeypatch.setitem(families.FAMILIES, "toy", toy)
    c = rhf.config_from_hf(dict(TINY, model_type="toy", logit_cap=7.0))
    assert c.features.qk_norm and c.features.final_logit_soft_cap == 7.0 and c.max_seq_len == 1024
    d = rhf.hf_config_dict(c, "toy")
    assert (d["architectures"], d["logit_cap"], d["hidden_act"]) == (["ToyForCausalLM"], 7.0, "silu")
    assert rhf.config_from_hf(d) == c
    names = toy.name_map(c)
    assert names["layers.mlp_norm.weight"].hf_name(3) == "model.layers.3.pre_mlp_norm.weight"
    assert names["layers.attention.q_norm.weight"].hf_name(0) == "model.layers.0.self_attn.q_norm.weight"
    with pytest.raises(ValueError, match=r"hidden_act='gelu', which is not SwiGLU"):
        rhf.config_from_hf(dict(TINY, model_type="toy", hidden_act="gelu"))


def test_a_record_that_converts_a_field_twice_is_refused():
    with pytest.raises(ValueError, match=r"toy: a field is converted by two features or also fixed"):
        Family("toy", "ToyForCausalLM", {}, fixed=dict(final_logit_soft_cap=None), norms={},
               features=(Key("final_logit_soft_cap", "logit_cap"),))


def test_unknown_model_types_are_named_with_the_supported_ones():
    with pytest.raises(ValueError, match=r"model_type='gpt2' is not supported: config.json's model_type must be one "
                                         r"of \('llama', 'mistral', 'qwen2', 'qwen3', 'gemma2', 'gemma3_text'\)"):
        rhf.config_from_hf(dict(TINY, model_type="gpt2"))
    with pytest.raises(ValueError, match=r"model_type=None is not supported"):
        rhf.config_from_hf(dict(TINY))
    with pytest.raises(ValueError, match=r"model_type='gpt2' is not supported: use one of"):
        rhf.hf_config_dict(TransformerConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=2), "gpt2")


def test_gemma3_ignores_attn_logit_softcapping_as_transformers_does():
    """transformers' Gemma 3 keeps ``attn_logit_softcapping`` in its config but its attention never
    passes it on (``Gemma3Attention.forward``); Gemma 2 applies it."""
    caps = dict(TINY, head_dim=16, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    gemma3 = rhf.config_from_hf(dict(caps, model_type="gemma3_text"))
    gemma2 = rhf.config_from_hf(dict(caps, model_type="gemma2"))
    assert (gemma3.logit_soft_cap, gemma3.features.final_logit_soft_cap) == (None, 3.0)
    assert (gemma2.logit_soft_cap, gemma2.features.final_logit_soft_cap) == (5.0, 3.0)
