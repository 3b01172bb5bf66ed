"""The supported Hugging Face families: one ``Family`` record each (``family.py``), in one table.

Adding a family is adding its record here (and its parity test in ``tests/test_hf.py``): its
transformers defaults, the ``TransformerConfig`` fields its architecture fixes, its features (from
``features.py``; a new kind of difference adds one there) and its norm tensors' names.
``family_of(d)`` finds a config.json's record; ``infer_model_type(c)`` the record a config is.
"""

from ringsplash.hf.family import Family
from ringsplash.hf.features import (
    Activation,
    Key,
    LayerTypes,
    LocalRope,
    QueryScale,
    QwenLayerTypes,
    UniformWindow,
    alternating,
    every_nth_full,
    from_max_window_layers,
)
from ringsplash.hf.names import LAYER
from ringsplash.model.config import TransformerConfig

# ------------------------------------------------------------------------------ shared parts

_COMMON = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", rope_theta=10_000.0,
               attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
_LLAMA_IDS = dict(bos_token_id=1, eos_token_id=2)
_QWEN = dict(_COMMON, max_position_embeddings=32768, sliding_window=4096, max_window_layers=28,
             use_sliding_window=False)
_GEMMA = dict(_COMMON, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
              sliding_window=4096, bos_token_id=2, eos_token_id=1, pad_token_id=0)

_SWIGLU = Activation("silu", keys=("hidden_act",), accepted=("silu",), what="the SwiGLU")
_GEGLU = Activation("gelu_tanh", keys=("hidden_activation", "hidden_act"), accepted=("gelu_pytorch_tanh", "gelu_tanh"),
                    what="gemma's tanh-approximated GeLU")
#: what the SwiGLU families' config.json says about biases (the model has none but Qwen2's q/k/v ones)
_NO_BIASES = dict(attention_bias=False, mlp_bias=False)
#: gemma: norms scale by ``1 + weight``, the attention and MLP outputs are normalised too, embeddings scaled
_GEMMA_FIXED = dict(norm_offset=1.0, post_norms=True, scale_embeddings=True)

#: Llama's ``post_attention_layernorm`` is the pre-MLP norm; Gemma's normalises the attention output
_PRE_MLP_NORM = {"layers.mlp_norm.weight": LAYER + "post_attention_layernorm.weight"}
_GEMMA_NORMS = {
    "layers.post_attention_norm.weight": LAYER + "post_attention_layernorm.weight",
    "layers.mlp_norm.weight": LAYER + "pre_feedforward_layernorm.weight",
    "layers.post_mlp_norm.weight": LAYER + "post_feedforward_layernorm.weight",
}

# ------------------------------------------------------------------------------ the records

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", dict(_COMMON, max_position_embeddings=2048, **_LLAMA_IDS),
           fixed={}, features=(_SWIGLU,), norms=_PRE_MLP_NORM, constants=_NO_BIASES),
    Family("mistral", "MistralForCausalLM", dict(_COMMON, max_position_embeddings=131072, sliding_window=4096,
                                                 num_key_value_heads=8, **_LLAMA_IDS),
           fixed={}, features=(_SWIGLU, UniformWindow()), norms=_PRE_MLP_NORM, constants=_NO_BIASES),
    Family("qwen2", "Qwen2ForCausalLM", _QWEN, fixed=dict(attention_bias=True),
           features=(_SWIGLU, QwenLayerTypes(from_max_window_layers)), norms=_PRE_MLP_NORM, constants=_NO_BIASES),
    Family("qwen3", "Qwen3ForCausalLM", _QWEN, fixed=dict(qk_norm=True),
           features=(_SWIGLU, QwenLayerTypes(from_max_window_layers)), norms=_PRE_MLP_NORM, constants=_NO_BIASES),
    Family("gemma2", "Gemma2ForCausalLM", dict(_GEMMA, max_position_embeddings=8192, attn_logit_softcapping=50.0,
                                               final_logit_softcapping=30.0),
           fixed=_GEMMA_FIXED, norms=_GEMMA_NORMS,
           features=(_GEGLU, QueryScale(), Key("logit_soft_cap", "attn_logit_softcapping"),
                     Key("final_logit_soft_cap", "final_logit_softcapping"), LayerTypes(alternating))),
    # transformers' Gemma 3 keeps attn_logit_softcapping in its config but never applies it: neither do we
    Family("gemma3_text", "Gemma3ForCausalLM", dict(_GEMMA, max_position_embeddings=131072, rope_theta=1_000_000.0,
                                                    rope_local_base_freq=10_000.0),
           fixed=dict(_GEMMA_FIXED, qk_norm=True), norms=_GEMMA_NORMS,
           features=(_GEGLU, QueryScale(), Key("final_logit_soft_cap", "final_logit_softcapping"),
                     LayerTypes(every_nth_full), LocalRope())),
)}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)


def family_of(d: dict) -> Family:
    """The record of config.json ``d``'s ``model_type``; a ``ValueError`` lists the supported ones."""
    model_type = d.get("model_type")
    if model_type == "gemma3" and isinstance(d.get("text_config"), dict):
        raise ValueError("model_type='gemma3' is the multimodal Gemma 3 (Gemma3ForConditionalGeneration): only the "
                         "text model is supported, model_type='gemma3_text' (Gemma3ForCausalLM)")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not supported: config.json's model_type must be one of "
                         f"{SUPPORTED_MODEL_TYPES}")
    return FAMILIES[model_type]


def family_named(model_type: str) -> Family:
    """The record of ``model_type`` (as ``save_hf(model_type=...)`` names it)."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not supported: use one of {SUPPORTED_MODEL_TYPES}")
    return FAMILIES[model_type]


def infer_model_type(c: TransformerConfig) -> str:
    """The family ``c`` is: the first in the table that expresses all of it (Llama before Mistral:
    a causal mask is both), else the one that misses least (``to_hf`` then names what it misses)."""
    misses = {t: len(f.mismatches(c)) for t, f in FAMILIES.items()}
    return min(FAMILIES, key=lambda t: misses[t])


__all__ = ["FAMILIES", "SUPPORTED_MODEL_TYPES", "family_named", "family_of", "infer_model_type"]
