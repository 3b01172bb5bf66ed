"""``Family``: one Hugging Face model family (``model_type``) as a record, both directions.

``fields_from_hf(d)`` turns a config.json dict into ``TransformerConfig`` fields and ``to_hf(c)``
turns a ``TransformerConfig`` back into the config.json transformers rebuilds the model from. What
every family shares (sizes, norms' eps, tied embeddings, RoPE, token ids) is converted here; what
differs is data on the record: the fields the family fixes (``fixed``), its ``features`` (each a
converter both ways, ``features.py``), the names of its norm tensors (``norms``) and transformers'
defaults for keys a file leaves out (``defaults``). The records themselves are in ``families.py``.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from ringsplash.hf.features import Feature
from ringsplash.hf.names import TensorName, name_map
from ringsplash.model.config import TransformerConfig
from ringsplash.model.hf_features import ModelFeatures, config_value, nest_features
from ringsplash.model.rope_scaling import RopeScaling

#: the ``TransformerConfig`` fields (by their flat names: ``ModelFeatures``' fields are under ``features``)
#: that tell families apart: a family converts each with one of its features, or fixes it
#: (``Family.fixed``, else the default) in both directions
FEATURE_FIELDS = ("mask", "mlp_activation", "attention_bias", "qk_norm", "norm_offset", "post_norms",
                  "scale_embeddings", "attention_scale", "logit_soft_cap", "final_logit_soft_cap", "layer_types",
                  "sliding_window", "local_rope_theta")
_CONFIG_DEFAULTS = {f.name: f.default for cls in (TransformerConfig, ModelFeatures) for f in dataclasses.fields(cls)}
#: rope types whose model runs past ``max_position_embeddings``: the scaled length is
#: ``original_max_position_embeddings * factor`` (``dynamic``: ``max_position_embeddings * factor``)
SCALED_ROPE_TYPES = ("dynamic", "yarn", "llama3", "longrope")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclasses.dataclass(frozen=True)
class Family:
    """One ``model_type``.

    Attributes:
        model_type: config.json's ``model_type``.
        architecture: the transformers class (config.json's ``architectures``).
        defaults: transformers' values for config.json keys a file may leave out.
        fixed: ``TransformerConfig`` fields whose value the architecture fixes (set when reading,
            required when writing); a field of ``FEATURE_FIELDS`` neither here nor converted by a
            feature is fixed at ``TransformerConfig``'s default.
        features: the converters of the family's other differences (``features.py``).
        norms: ``{parameter path: HF tensor}`` of the layer norms besides ``input_layernorm``
            (``{i}``: the layer); every other tensor name is shared (``names.py``).
        constants: config.json keys written as-is (values transformers must see).
    """

    model_type: str
    architecture: str
    defaults: Mapping[str, Any]
    fixed: Mapping[str, Any]
    features: tuple[Feature, ...]
    norms: Mapping[str, str]
    constants: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        owned = [f for feature in self.features for f in feature.fields]
        both = sorted(set(owned) & set(self.fixed))
        if both or len(owned) != len(set(owned)):
            raise ValueError(f"{self.model_type}: a field is converted by two features or also fixed: {owned}, "
                             f"fixed {sorted(self.fixed)}")

    # ----------------------------------------------------------------------- config.json -> fields

    def fields_from_hf(self, d: dict) -> dict:
        """The ``TransformerConfig`` keyword arguments of config.json ``d`` (already type-checked,
        ``config.py``), the family options in ``features``."""
        for feature in self.features:
            d = feature.normalise(d)
        get = lambda key: d.get(key, self.defaults.get(key))
        d_model, heads = int(_required(d, "hidden_size")), int(_required(d, "num_attention_heads"))
        max_pos = int(get("max_position_embeddings"))
        theta, rope = _rope_from_hf(d, get, max_pos)
        eos = get("eos_token_id")
        fields = dict(
            vocab_size=int(_required(d, "vocab_size")), d_model=d_model, num_heads=heads,
            num_layers=int(_required(d, "num_hidden_layers")),
            num_kv_heads=int(d.get("num_key_value_heads") or self.defaults.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d_model // heads),
            intermediate_size=int(_required(d, "intermediate_size")),
            rope_theta=theta, rope_scaling=rope, max_seq_len=scaled_max_len(max_pos, rope),
            norm_eps=float(get("rms_norm_eps")), tie_embeddings=bool(get("tie_word_embeddings")),
            bos_token_id=get("bos_token_id"), eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=get("pad_token_id"), **self.fixed)
        for feature in self.features:
            fields.update(feature.read(d, get))
        return nest_features(fields)

    # ----------------------------------------------------------------------- fields -> config.json

    def mismatches(self, c: TransformerConfig) -> list[str]:
        """What of ``c`` this family cannot express (empty: ``to_hf(c)`` writes it)."""
        out = []
        if c.sinks:
            out.append("sinks=True (attention sinks have no Hugging Face tensor here)")
        if c.v_head_dim != c.head_dim:
            out.append(f"v_head_dim={c.v_head_dim} != head_dim={c.head_dim}")
        owned = {f for feature in self.features for f in feature.fields}
        for name in FEATURE_FIELDS:
            want = self.fixed.get(name, _CONFIG_DEFAULTS[name])
            if name not in owned and not _same(config_value(c, name), want):
                out.append(f"{name}={config_value(c, name)!r} (the family has {want!r})")
        for feature in self.features:
            out.extend(feature.mismatches(c))
        return out

    def to_hf(self, c: TransformerConfig) -> dict:
        """The config.json of ``c`` (less the stored dtype); a ``ValueError`` names everything the
        family cannot express."""
        problems = self.mismatches(c)
        if problems:
            raise ValueError(f"this model cannot be written as model_type={self.model_type!r}: {'; '.join(problems)}")
        f = c.features
        scaling = f.rope_scaling or RopeScaling()  # None: ringsplash's formula, within 1 float32 ulp of transformers'
        max_pos = c.max_seq_len
        if scaling.type == "dynamic":
            max_pos = scaling.original_max_position_embeddings
        d = dict(architectures=[self.architecture], model_type=self.model_type, vocab_size=c.vocab_size,
                 hidden_size=c.d_model, intermediate_size=c.mlp_hidden, num_hidden_layers=c.num_layers,
                 num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                 max_position_embeddings=max_pos, rms_norm_eps=f.norm_eps, tie_word_embeddings=f.tie_embeddings,
                 attention_dropout=0.0, rope_parameters=scaling.to_hf(rope_theta=c.rope_theta), **token_ids(c),
                 **self.constants)
        for feature in self.features:
            d.update(feature.write(c, d))
        return d

    # ----------------------------------------------------------------------- weights

    def name_map(self, config: TransformerConfig) -> dict[str, TensorName]:
        """``{parameter path: TensorName}`` of ``Transformer(config)`` in this family's checkpoints."""
        return name_map(config, self.norms)


def _same(value, want) -> bool:
    if isinstance(want, str) or isinstance(value, str):  # a mask may be a Mask or a function
        return isinstance(value, str) and value == want
    return value == want if want is not None else value is None


def _required(d: dict, key: str):
    if d.get(key) is None:
        raise ValueError(f"config.json lacks {key} (needed to build the model)")
    return d[key]


def token_ids(c: TransformerConfig) -> dict:
    """bos / eos / pad ids as config.json records them (null when unset, so a family default is not
    substituted when the file is read back); several eos ids as a list."""
    return {name: list(v) if isinstance(v := getattr(c.features, name), tuple) else v for name in _TOKEN_IDS}


def _rope_from_hf(d: dict, get, max_pos: int) -> tuple[float, RopeScaling]:
    """(rope_theta, the ``RopeScaling``) of ``rope_scaling`` or the newer ``rope_parameters``."""
    scaling = d.get("rope_scaling") or d.get("rope_parameters")  # transformers: a non-empty rope_scaling wins
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling / rope_parameters must be a dict or null, got {scaling!r}")
    theta = (scaling or {}).get("rope_theta", get("rope_theta"))
    rope = RopeScaling.from_hf(dict(scaling or {}), max_position_embeddings=max_pos,
                               original_max_position_embeddings=d.get("original_max_position_embeddings"),
                               rope_theta=theta)
    return float(theta), rope


def scaled_max_len(max_position_embeddings: int, rope: RopeScaling) -> int:
    """The longest sequence a model with this RoPE scaling runs: ``max_position_embeddings``, or for
    ``SCALED_ROPE_TYPES`` the larger of it and ``original_max_position_embeddings * factor`` (a
    Qwen-style config keeps ``max_position_embeddings`` at the original length and scales by the factor;
    Llama 3.1 / DeepSeek / Phi-3 already write the scaled length there)."""
    if rope.type not in SCALED_ROPE_TYPES:
        return max_position_embeddings
    return max(max_position_embeddings, int(rope.original_max_position_embeddings * rope.factor))


__all__ = ["FEATURE_FIELDS", "SCALED_ROPE_TYPES", "Family", "scaled_max_len", "token_ids"]
