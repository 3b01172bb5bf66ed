"""config.json → ``TransformerConfig`` (``config_from_hf``).

``config_from_hf`` reads a Hugging Face ``config.json`` (a checkpoint directory, the file, or the
dict) into the ``TransformerConfig`` of the same function: every key that changes the model is
either mapped or refused with a ``ValueError`` naming it (a rope type RopeScaling does not know,
MoE, biases the model has no parameter for, ...), never silently dropped; a value of the wrong JSON type is
refused by name (``check_types``), as transformers' strict config classes do. The special token
ids are kept on the config (``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``); other keys that
only concern training or generation in transformers (dropout, initialisation, cache) are ignored.

What differs between families is on their records (``families.py``); this module reads the file,
checks the JSON types and refuses what no family builds (mixture of experts, MLP biases, ...).
``hf_config_dict`` (``save.py``) is the inverse, for ``save_hf``.
"""

import json
import os
from typing import Any

from ringsplash.hf.families import SUPPORTED_MODEL_TYPES, Family, family_of
from ringsplash.hf.family import SCALED_ROPE_TYPES, scaled_max_len
from ringsplash.hf.features import refuse
from ringsplash.model.config import TransformerConfig
from ringsplash.model.hf_features import nest_features

#: keys whose presence (with a non-empty value) means a mixture-of-experts model
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok",
             "router_aux_loss_coef")

#: the JSON type of every config.json key read here (transformers' strict config classes refuse any other:
#: ``"tie_word_embeddings": "false"`` is not false, ``"hidden_size": 64.7`` is not 64); null means absent
_INT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "original_max_position_embeddings",
             "sliding_window", "max_window_layers", "sliding_window_pattern", "_sliding_window_pattern",
             "bos_token_id", "pad_token_id")
#: the int keys that are sizes (of the model or of its training length): 0 or less is no model. ``head_dim: 0``
#: and ``num_key_value_heads: 0`` read as absent (the derived value) and ``num_attention_heads: 0`` divided by
#: zero before this check
_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "original_max_position_embeddings")
_FLOAT_KEYS = ("rms_norm_eps", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar",
               "attn_logit_softcapping", "final_logit_softcapping", "partial_rotary_factor")
_BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
              "use_bidirectional_attention", "is_encoder_decoder")
_STR_KEYS = ("hidden_act", "hidden_activation")


def _type_error(key: str, value: Any, expected: str) -> TypeError:
    return TypeError(f"config.json has {key}={value!r} ({type(value).__name__}), expected {expected}; "
                     f"refusing to load it as another value (transformers' config classes refuse it too)")


def _size_error(key: str, value: Any) -> ValueError:
    return ValueError(f"config.json has {key}={value!r}, expected an int >= 1 (a size); refusing to load it")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_types(d: dict) -> None:
    """A ``TypeError`` naming the first config.json key whose value has the wrong JSON type (an int
    where a float is expected is accepted: it is exact)."""
    for key in _INT_KEYS:
        if d.get(key) is not None and not _is_int(d[key]):
            raise _type_error(key, d[key], "an int")
    for key in _SIZE_KEYS:
        if d.get(key) is not None and d[key] < 1:
            raise _size_error(key, d[key])
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
    fam = family_of(d)
    value = d.get("max_position_embeddings", fam.defaults.get("max_position_embeddings"))
    if not _is_int(value):
        raise _type_error("max_position_embeddings", value, "an int")
    if value < 1:
        raise _size_error("max_position_embeddings", value)
    return value


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
        try:
            config = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:  # the message alone named no file
            raise ValueError(f"{file!r} is not a Hugging Face config.json: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file!r} is not a Hugging Face config.json: it holds a {type(config).__name__}, not an "
                         f"object of fields")
    return config


def _check_flags(d: dict, fam: Family) -> None:
    for key in _MOE_KEYS:
        if d.get(key):
            refuse(key, d[key], "makes a mixture-of-experts model (not supported: dense MLPs only)")
    if d.get("mlp_bias"):
        refuse("mlp_bias", d["mlp_bias"], "adds MLP biases (the model's MLP has none)")
    if d.get("attention_bias") and not fam.fixed.get("attention_bias"):  # Qwen2's q/k/v biases need no key
        refuse("attention_bias", d["attention_bias"], f"adds a bias to o_proj too in {fam.model_type} "
               "(the model has q/k/v biases only)")
    if d.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention", True, "makes attention bidirectional (causal only)")
    if float(d.get("partial_rotary_factor") or 1.0) != 1.0:
        refuse("partial_rotary_factor", d["partial_rotary_factor"], "rotates part of each head only (RoPE over "
               "the whole head here)")
    if d.get("is_encoder_decoder"):
        refuse("is_encoder_decoder", True, "is not a decoder-only model")


def hf_model_fields(d: dict) -> dict:
    """The ``TransformerConfig`` keyword arguments of a config.json dict (its family's ``fields_from_hf``, after
    the type checks and the refusals every family shares)."""
    fam = family_of(d)
    check_types(d)
    _check_flags(d, fam)
    return fam.fields_from_hf(d)


def config_from_hf(path_or_dict, **overrides) -> TransformerConfig:
    """The ``TransformerConfig`` of a Hugging Face config.json alone (no weights read).

    Args:
        path_or_dict: a checkpoint directory (as ``save_pretrained`` writes it), its config.json,
            or the dict; ``model_type`` one of ``SUPPORTED_MODEL_TYPES``.
        **overrides: ``TransformerConfig`` fields set on top (``context_parallel``, ``max_seq_len``,
            dtypes, ...; a ``ModelFeatures`` field by its name, e.g. ``rope_scaling``), validated with the rest.

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
    return TransformerConfig(**nest_features({**hf_model_fields(read_config_json(path_or_dict)), **overrides}))


__all__ = ["SCALED_ROPE_TYPES", "SUPPORTED_MODEL_TYPES", "check_types", "config_from_hf", "hf_model_fields",
           "max_position_embeddings", "read_config_json", "scaled_max_len"]
