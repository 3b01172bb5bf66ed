"""config.json ↔ ``TransformerConfig``, per model family (``model_type``).

``config_from_hf`` reads a Hugging Face ``config.json`` (a checkpoint directory, the file, or the
dict) into the ``TransformerConfig`` of the same function: every key that changes the model is
either mapped or refused with a ``ValueError`` naming it (a rope type RopeScaling does not know,
MoE, biases the model has no parameter for, ...), never silently dropped; a value of the wrong JSON type is
refused by name (``check_types``), as transformers' strict config classes do. The special token
ids are kept on the config (``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``); other keys that
only concern training or generation in transformers (dropout, initialisation, cache) are ignored.

``hf_config_dict`` is the inverse, for ``save_hf``: the config.json transformers rebuilds the
model from.

A model feature the installed ``TransformerConfig`` does not have (a field being added in
parallel: the model side grows per family) is refused by name when config.json needs it with a
non-default value, so a family is rejected as "not supported yet" rather than loaded wrong.
"""

import dataclasses
import json
import os
from typing import Any

from ringsplash.model.config import TransformerConfig
from ringsplash.model.rope_scaling import RopeScaling


@dataclasses.dataclass(frozen=True)
class Family:
    """What differs between the supported families: their class names, the config.json defaults
    transformers uses for keys a file leaves out, and the role of ``post_attention_layernorm``."""

    model_type: str
    architecture: str
    defaults: dict
    #: gemma's ``post_attention_layernorm`` normalises the attention output (``post_norms``); the others'
    #: is the pre-MLP norm
    gemma_norms: bool = False


_COMMON = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", rope_theta=10_000.0,
               attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
_GEMMA = dict(_COMMON, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
              sliding_window=4096, bos_token_id=2, eos_token_id=1, pad_token_id=0)
_LLAMA_IDS = dict(bos_token_id=1, eos_token_id=2)
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM", dict(_COMMON, max_position_embeddings=2048, **_LLAMA_IDS)),
    "mistral": Family("mistral", "MistralForCausalLM", dict(_COMMON, max_position_embeddings=131072,
                                                            sliding_window=4096, num_key_value_heads=8, **_LLAMA_IDS)),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", dict(_COMMON, max_position_embeddings=32768, sliding_window=4096,
                                                      max_window_layers=28, use_sliding_window=False)),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", dict(_COMMON, max_position_embeddings=32768, sliding_window=4096,
                                                      max_window_layers=28, use_sliding_window=False)),
    "gemma2": Family("gemma2", "Gemma2ForCausalLM", dict(_GEMMA, max_position_embeddings=8192,
                                                         attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
                     gemma_norms=True),
    "gemma3_text": Family("gemma3_text", "Gemma3ForCausalLM", dict(_GEMMA, max_position_embeddings=131072,
                                                                   rope_theta=1_000_000.0,
                                                                   rope_local_base_freq=10_000.0),
                          gemma_norms=True),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)

#: keys whose presence (with a non-empty value) means a mixture-of-experts model
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok",
             "router_aux_loss_coef")

#: the value every model field below has on a ``TransformerConfig`` that lacks the field (today's model)
_IMPLICIT = dict(intermediate_size=None, mlp_activation="silu", attention_bias=False, qk_norm=False, norm_eps=1e-6,
                 norm_offset=0.0, post_norms=False, scale_embeddings=False, attention_scale=None,
                 final_logit_soft_cap=None, layer_types=None, sliding_window=None, local_rope_theta=None,
                 bos_token_id=None, eos_token_id=None, pad_token_id=None)

#: the JSON type of every config.json key read here (transformers' strict config classes refuse any other:
#: ``"tie_word_embeddings": "false"`` is not false, ``"hidden_size": 64.7`` is not 64); null means absent
_INT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "original_max_position_embeddings",
             "sliding_window", "max_window_layers", "sliding_window_pattern", "_sliding_window_pattern",
             "bos_token_id", "pad_token_id")
_FLOAT_KEYS = ("rms_norm_eps", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar",
               "attn_logit_softcapping", "final_logit_softcapping", "partial_rotary_factor")
_BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
              "use_bidirectional_attention", "is_encoder_decoder")
_STR_KEYS = ("hidden_act", "hidden_activation")
#: rope types whose model runs past ``max_position_embeddings``: the scaled length is
#: ``original_max_position_embeddings * factor`` (``dynamic``: ``max_position_embeddings * factor``)
SCALED_ROPE_TYPES = ("dynamic", "yarn", "llama3", "longrope")


def _type_error(key: str, value: Any, expected: str) -> TypeError:
    return TypeError(f"config.json has {key}={value!r} ({type(value).__name__}), expected {expected}; "
                     f"refusing to load it as another value (transformers' config classes refuse it too)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_types(d: dict) -> None:
    """A ``TypeError`` naming the first config.json key whose value has the wrong JSON type (an int
    where a float is expected is accepted: it is exact)."""
    for key in _INT_KEYS:
        if d.get(key) is not None and not _is_int(d[key]):
            raise _type_error(key, d[key], "an int")
    for key in _FLOAT_KEYS:
        if d.get(key) is not None and not (isinstance(d[key], float) or _is_int(d[key])):
            raise _type_error(key, d[key], "a number")
    for key in _BOOL_KEYS:
        if d.get(key) is not None and not isinstance(d[key], bool):
            raise _type_error(key, d[key], "a bool (true / false)")
    for key in _STR_KEYS:
        if d.get(key) is not None and not isinstance(d[key], str):
            raise _type_error(key, d[key], "a string")
    eos = d.get("eos_token_id")
    if eos is not None and not (_is_int(eos) or (isinstance(eos, list) and all(_is_int(t) for t in eos))):
        raise _type_error("eos_token_id", eos, "an int or a list of ints")
    types = d.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise _type_error("layer_types", types, "a list of strings")


def max_position_embeddings(path_or_dict) -> int:
    """config.json's ``max_position_embeddings`` (the family's default where absent): the length the
    model was trained at, before any RoPE scaling's ``scaled_max_len``."""
    d = read_config_json(path_or_dict)
    fam = _family(d)
    value = d.get("max_position_embeddings", fam.defaults.get("max_position_embeddings"))
    if not _is_int(value):
        raise _type_error("max_position_embeddings", value, "an int")
    return value


def scaled_max_len(max_position_embeddings: int, rope: RopeScaling) -> int:
    """The longest sequence a model with this RoPE scaling runs: ``max_position_embeddings``, or for
    ``SCALED_ROPE_TYPES`` the larger of it and ``original_max_position_embeddings * factor`` (a
    Qwen-style config keeps ``max_position_embeddings`` at the original length and scales by the factor;
    Llama 3.1 / DeepSeek / Phi-3 already write the scaled length there)."""
    if rope.type not in SCALED_ROPE_TYPES:
        return max_position_embeddings
    return max(max_position_embeddings, int(rope.original_max_position_embeddings * rope.factor))


def read_config_json(path_or_dict) -> dict:
    """The config dict of a checkpoint directory, a config.json path, or a dict (copied)."""
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise TypeError(f"path_or_dict must be a directory, a config.json path or a dict, got "
                        f"{type(path_or_dict).__name__}")
    path = os.fspath(path_or_dict)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no config.json at {file!r} (path_or_dict={path!r}: a checkpoint directory as "
                                f"written by save_pretrained, its config.json, or the dict)")
    with open(file) as f:
        return json.load(f)


def _family(d: dict) -> Family:
    model_type = d.get("model_type")
    if model_type == "gemma3" and isinstance(d.get("text_config"), dict):
        raise ValueError("model_type='gemma3' is the multimodal Gemma 3 (Gemma3ForConditionalGeneration): only the "
                         "text model is supported, model_type='gemma3_text' (Gemma3ForCausalLM)")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not supported: config.json's model_type must be one of "
                         f"{SUPPORTED_MODEL_TYPES}")
    return FAMILIES[model_type]


def _rope(d: dict, fam: Family, max_pos: int) -> tuple[float, RopeScaling, float | None]:
    """(rope_theta, scaling of the full-attention layers, gemma3's sliding-layer base or None)."""
    params = d.get("rope_parameters")
    local_theta = None
    top_theta = d.get("rope_theta", fam.defaults.get("rope_theta"))
    if fam.model_type == "gemma3_text":
        local_theta = d.get("rope_local_base_freq", fam.defaults["rope_local_base_freq"])
        if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
            unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
            if unknown:
                raise ValueError(f"rope_parameters has layer types {unknown}: gemma3 has full_attention and "
                                 f"sliding_attention only")
            local = dict(params.get("sliding_attention") or {})
            local_theta = local.pop("rope_theta", local_theta)
            kind = local.pop("rope_type", local.pop("type", "default"))
            if kind != "default" or local:
                raise ValueError(f"rope_parameters['sliding_attention'] = {params['sliding_attention']!r}: the "
                                 f"sliding layers' RoPE must be plain (rope_type 'default', rope_theta), got "
                                 f"rope_type={kind!r}{' and ' + str(sorted(local)) if local else ''}")
            params = params.get("full_attention")
        if d.get("rope_scaling"):  # transformers: an old rope_scaling updates the full layers' parameters
            params = {**(params or {}), **d["rope_scaling"]}
    # transformers: a (non-empty) rope_scaling wins over rope_parameters
    scaling = d.get("rope_scaling") or params
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling / rope_parameters must be a dict or null, got {scaling!r}")
    theta = (scaling or {}).get("rope_theta", top_theta)
    rope = RopeScaling.from_hf(dict(scaling or {}), max_position_embeddings=max_pos,
                               original_max_position_embeddings=d.get("original_max_position_embeddings"),
                               rope_theta=theta)
    return float(theta), rope, None if local_theta is None else float(local_theta)


def _refuse(d: dict, key: str, value: Any, why: str) -> None:
    raise ValueError(f"config.json has {key}={value!r}, which {why}; refusing to load a different model")


def _check_flags(d: dict, fam: Family) -> None:
    for key in _MOE_KEYS:
        if d.get(key):
            _refuse(d, key, d[key], "makes a mixture-of-experts model (not supported: dense MLPs only)")
    if d.get("mlp_bias"):
        _refuse(d, "mlp_bias", d["mlp_bias"], "adds MLP biases (the model's MLP has none)")
    if fam.model_type != "qwen2" and d.get("attention_bias"):
        _refuse(d, "attention_bias", d["attention_bias"], f"adds a bias to o_proj too in {fam.model_type} "
                "(the model has q/k/v biases only)")
    if d.get("use_bidirectional_attention"):
        _refuse(d, "use_bidirectional_attention", True, "makes attention bidirectional (causal only)")
    if float(d.get("partial_rotary_factor") or 1.0) != 1.0:
        _refuse(d, "partial_rotary_factor", d["partial_rotary_factor"], "rotates part of each head only (RoPE over "
                "the whole head here)")
    if d.get("is_encoder_decoder"):
        _refuse(d, "is_encoder_decoder", True, "is not a decoder-only model")
    if "gemma" not in fam.model_type:
        act = d.get("hidden_act", "silu")
        if act != "silu":
            _refuse(d, "hidden_act", act, f"is not the SwiGLU of {fam.model_type} (hidden_act 'silu')")


def _layer_types(d: dict, fam: Family, num_layers: int) -> tuple[tuple[str, ...] | None, int | None]:
    """(per-layer attention kinds, sliding window in HF's convention) of gemma / qwen configs."""
    window = d.get("sliding_window", fam.defaults.get("sliding_window"))
    types = d.get("layer_types")
    if fam.model_type in ("qwen2", "qwen3"):
        if not d.get("use_sliding_window", False):
            window = None
        if types is None:
            lo = d.get("max_window_layers", fam.defaults["max_window_layers"])
            types = ["sliding_attention" if window is not None and i >= lo else "full_attention"
                     for i in range(num_layers)]
    elif fam.model_type == "gemma2" and types is None:
        types = ["sliding_attention" if not i % 2 else "full_attention" for i in range(num_layers)]
    elif fam.model_type == "gemma3_text" and types is None:
        pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    types = tuple(types)
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers={num_layers}")
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad:
        raise ValueError(f"layer_types has {bad}: supported are 'full_attention' and 'sliding_attention'")
    if "sliding_attention" in types and not window:
        raise ValueError(f"layer_types has sliding layers but sliding_window={window!r}")
    if "sliding_attention" not in types:
        return None, None
    return types, int(window)


def _required(d: dict, key: str):
    if d.get(key) is None:
        raise ValueError(f"config.json lacks {key} (needed to build the model)")
    return d[key]


def hf_model_fields(d: dict) -> dict:
    """The ``TransformerConfig`` fields (some possibly not in the installed model yet, see
    ``_IMPLICIT``) of a config.json dict."""
    fam = _family(d)
    check_types(d)
    _check_flags(d, fam)
    get = lambda key: d.get(key, fam.defaults.get(key))
    d_model, heads = int(_required(d, "hidden_size")), int(_required(d, "num_attention_heads"))
    num_layers = int(_required(d, "num_hidden_layers"))
    max_pos = int(get("max_position_embeddings"))
    theta, rope, local_theta = _rope(d, fam, max_pos)
    eos = get("eos_token_id")
    fields = dict(
        vocab_size=int(_required(d, "vocab_size")), d_model=d_model, num_layers=num_layers, num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or fam.defaults.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or d_model // heads), intermediate_size=int(_required(d, "intermediate_size")),
        rope_theta=theta, rope_scaling=rope, max_seq_len=scaled_max_len(max_pos, rope),
        norm_eps=float(get("rms_norm_eps")), tie_embeddings=bool(get("tie_word_embeddings")),
        bos_token_id=get("bos_token_id"), eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=get("pad_token_id"),
    )
    if fam.model_type == "mistral":
        window = d.get("sliding_window", fam.defaults["sliding_window"])
        if window is not None:  # a query sees itself and the sliding_window - 1 tokens before it
            fields.update(mask="local", local_window=int(window) - 1)
    if fam.model_type == "qwen2":
        fields["attention_bias"] = True
    if fam.model_type in ("qwen3", "gemma3_text"):
        fields["qk_norm"] = True
    if fam.model_type in ("qwen2", "qwen3", "gemma2", "gemma3_text"):
        types, window = _layer_types(d, fam, num_layers)
        fields.update(layer_types=types, sliding_window=window)
    if fam.gemma_norms:
        act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            _refuse(d, "hidden_activation", act, "is not gemma's tanh-approximated GeLU ('gelu_pytorch_tanh')")
        fields.update(mlp_activation="gelu_tanh", norm_offset=1.0, post_norms=True, scale_embeddings=True,
                      attention_scale=float(get("query_pre_attn_scalar")) ** -0.5,
                      logit_soft_cap=d.get("attn_logit_softcapping", fam.defaults.get("attn_logit_softcapping")),
                      final_logit_soft_cap=d.get("final_logit_softcapping",
                                                 fam.defaults.get("final_logit_softcapping")))
        if fam.model_type == "gemma3_text":
            fields["local_rope_theta"] = local_theta
    return fields


def model_supports(field: str) -> bool:
    """Whether the installed ``TransformerConfig`` has ``field``."""
    return field in {f.name for f in dataclasses.fields(TransformerConfig)}


def build_config(fields: dict, model_type: str = "", **overrides) -> TransformerConfig:
    """``TransformerConfig(**fields, **overrides)``, refusing (by name) a field the installed model
    lacks unless its value is what the model does without it."""
    fields = dict(fields)
    for name in list(fields):
        if model_supports(name):
            continue
        value = fields.pop(name)
        if value != _IMPLICIT[name]:
            raise ValueError(f"{model_type or 'this model'} needs {name}={value!r}, which this ringsplash's "
                             f"TransformerConfig does not support yet: model_type={model_type!r} is not supported "
                             f"yet with this config")
    return TransformerConfig(**{**fields, **overrides})


def config_from_hf(path_or_dict, **overrides) -> TransformerConfig:
    """The ``TransformerConfig`` of a Hugging Face config.json alone (no weights read).

    Args:
        path_or_dict: a checkpoint directory (as ``save_pretrained`` writes it), its config.json,
            or the dict; ``model_type`` one of ``SUPPORTED_MODEL_TYPES``.
        **overrides: ``TransformerConfig`` fields set on top (``attention``, ``max_seq_len``,
            dtypes, ring sizes, ...), validated with the rest.

    ``max_seq_len`` defaults to ``max_position_embeddings``, or with a ``dynamic`` / ``yarn`` /
    ``llama3`` / ``longrope`` RoPE scaling to the scaled length (``scaled_max_len``: e.g. 131072 for
    Qwen's ``max_position_embeddings`` 32768 with YaRN factor 4); pass ``max_seq_len=`` to choose
    another. RoPE (``rope_scaling`` or the newer ``rope_parameters``) becomes a ``RopeScaling``
    (``"default"`` when unscaled: transformers' numerics). ``bos_token_id`` / ``eos_token_id`` /
    ``pad_token_id`` (or the family's defaults, as transformers) are kept on the config. Any
    config.json value that would change the model and is not supported raises a ``ValueError``
    naming it; a value of the wrong JSON type (``"tie_word_embeddings": "false"``, ``"hidden_size":
    64.7``) a ``TypeError`` naming the key, the expected type and the value.
    """
    d = read_config_json(path_or_dict)
    return build_config(hf_model_fields(d), d.get("model_type", ""), **overrides)
