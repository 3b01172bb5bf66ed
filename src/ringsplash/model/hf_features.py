"""``ModelFeatures``: the ``TransformerConfig`` options Hugging Face families need (Llama, Mistral,
Qwen2/3, Gemma 2/3), their validation, and how a per-layer attention pattern (``layer_types``) is
cut into scanned segments.

Sliding-window convention (transformers' ``sliding_window_overlay``): a query at ``q`` sees the keys
``k`` with ``0 <= q - k < sliding_window``, i.e. itself and the ``sliding_window - 1`` previous
tokens, which is ringsplash's ``LocalMask(window=(sliding_window - 1, 0))``, or ``mask="local"``
with ``local_window = sliding_window - 1`` (what a Mistral checkpoint maps to).
"""

import dataclasses
from typing import Literal, NamedTuple

from ringsplash._internal.scalar_checks import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_positive_int,
    literal_choices,
    plain_fields,
)
from ringsplash.model.rope_scaling import RopeScaling, check_rope_dim

LayerType = Literal["full_attention", "sliding_attention"]
LAYER_TYPES: tuple[str, ...] = literal_choices(LayerType)
MlpActivation = Literal["silu", "gelu_tanh"]
MLP_ACTIVATIONS: tuple[str, ...] = literal_choices(MlpActivation)
SLIDING = "sliding_attention"


class LayerSegment(NamedTuple):
    """Layers ``start .. start + groups * len(kinds) - 1`` run as a ``lax.scan`` over ``groups`` steps,
    each running ``len(kinds)`` layers of the given layer types (None: the config's ``mask``)."""

    start: int
    groups: int
    kinds: tuple[str | None, ...]

    @property
    def num_layers(self) -> int:
        return self.groups * len(self.kinds)


@dataclasses.dataclass(frozen=True)
class ModelFeatures:
    """The options Hugging Face families need (a frozen, hashable value; the defaults keep ringsplash's
    own model). ``TransformerConfig.features`` holds one.

    ``intermediate_size``: the MLP's hidden width (None = ``mlp_ratio * d_model`` rounded up to
    ``mlp_multiple``); ``mlp_activation``: ``"silu"``, or ``"gelu_tanh"`` (Gemma's GeGLU);
    ``attention_bias``: q/k/v projection biases (Qwen2); ``qk_norm``: RMSNorm over head_dim on q and k
    per head before RoPE (Qwen3 / Gemma 3); ``norm_eps`` of every RMSNorm; ``norm_offset``: RMSNorm
    scales by ``norm_offset + weight`` in float32 (Gemma's 1.0; fresh weights are ``1 - norm_offset``);
    ``post_norms``: Gemma's RMSNorm on the attention and MLP outputs before the residual adds;
    ``scale_embeddings``: embeddings times sqrt(d_model), the factor rounded to the compute dtype first;
    ``attention_scale``: softmax scale (None = head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5);
    ``final_logit_soft_cap``: logits = cap * tanh(logits / cap), in float32; ``tie_embeddings``: the
    unembedding is ``embedding.T`` itself (a fresh tied model draws the embedding with std
    d_model ** -0.5); ``rope_scaling``: None or a ``RopeScaling`` (linear, dynamic NTK, YaRN, Llama 3,
    LongRoPE) with Hugging Face's numerics (``ringsplash.model.rope_scaling``); ``layer_types``: None,
    or per layer ``"full_attention"`` (the config's ``mask``) / ``"sliding_attention"``: a causal window
    of ``sliding_window`` tokens, the query included (``LocalMask(window=(sliding_window - 1, 0))``);
    ``local_rope_theta``: the RoPE base of sliding layers, unscaled (Gemma 3; None = the full layers'
    RoPE). ``bos_token_id`` / ``eos_token_id`` (an int or several) / ``pad_token_id``: the tokenizer's
    special ids as config.json records them (``ringsplash.hf`` reads and writes them; the model never does).
    """

    intermediate_size: int | None = None
    mlp_activation: MlpActivation = "silu"
    attention_bias: bool = False
    qk_norm: bool = False
    norm_eps: float = 1e-6
    norm_offset: float = 0.0
    post_norms: bool = False
    scale_embeddings: bool = False
    attention_scale: float | None = None
    final_logit_soft_cap: float | None = None
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    layer_types: tuple[LayerType, ...] | None = None
    sliding_window: int | None = None
    local_rope_theta: float | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        plain_fields(self)  # NumPy / JAX scalars as Python numbers
        if self.intermediate_size is not None:
            check_positive_int("intermediate_size", self.intermediate_size)
        check_choice("mlp_activation", self.mlp_activation, MLP_ACTIVATIONS)
        for name in ("attention_bias", "qk_norm", "post_norms", "scale_embeddings", "tie_embeddings"):
            check_bool(name, getattr(self, name))
        check_float("norm_eps", self.norm_eps, positive=True)
        check_float("norm_offset", self.norm_offset)
        for name in ("attention_scale", "final_logit_soft_cap"):
            if getattr(self, name) is not None:
                check_float(name, getattr(self, name), positive=True)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"rope_scaling must be a ringsplash.model.RopeScaling or None, got "
                            f"{type(self.rope_scaling).__name__} (a Hugging Face dict: RopeScaling.from_hf(d))")
        sliding = self._check_layer_types()
        if self.sliding_window is not None:
            check_positive_int("sliding_window", self.sliding_window)
            if not sliding:
                raise ValueError(f"sliding_window={self.sliding_window!r} only applies to layer_types with a "
                                 f"'sliding_attention' layer (layer_types={self.layer_types!r}): set "
                                 f"sliding_window=None, or for one window on every layer use mask='local', "
                                 f"local_window=sliding_window - 1")
        elif sliding:
            raise ValueError("layer_types has 'sliding_attention' layers, which need sliding_window=<int > 0> "
                             "(tokens a query sees, itself included, as in Hugging Face), got sliding_window=None")
        if self.local_rope_theta is not None:
            check_float("local_rope_theta", self.local_rope_theta, positive=True)
            if not sliding:
                raise ValueError(f"local_rope_theta={self.local_rope_theta!r} is the RoPE base of "
                                 f"'sliding_attention' layers, and layer_types={self.layer_types!r} has none: "
                                 f"set local_rope_theta=None")
        self._check_token_ids()

    def _check_layer_types(self) -> bool:
        """Whether ``layer_types`` (None or one known type per layer) has a sliding layer."""
        if self.layer_types is None:
            return False
        if isinstance(self.layer_types, str) or not isinstance(self.layer_types, tuple | list):
            raise ValueError(f"layer_types must be None or a sequence of {LAYER_TYPES} per layer, "
                             f"got layer_types={self.layer_types!r}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # JSON lists back to a (hashable) tuple
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise ValueError(f"layer_types entries must be one of {LAYER_TYPES}, got {t!r} in layer_types")
        return SLIDING in self.layer_types

    def _check_token_ids(self) -> None:
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is None:
                continue
            if name == "eos_token_id" and isinstance(value, (list, tuple)):
                value = tuple(check_int(f"eos_token_id[{i}]", t) for i, t in enumerate(value))
            else:
                value = check_int(name, value)
            object.__setattr__(self, name, value)

    def replace(self, **changes) -> "ModelFeatures":
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


#: the ``ModelFeatures`` field names (each also a ``TransformerConfig`` field name of the previous release)
FEATURE_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ModelFeatures))


def nest_features(fields: dict) -> dict:
    """``TransformerConfig`` keyword arguments with the ``ModelFeatures`` names among ``fields`` folded
    into ``features`` (on top of a ``features`` given): a table keyed by flat names (``ringsplash.hf``'s
    families) builds a config with it."""
    out = {k: v for k, v in fields.items() if k not in FEATURE_NAMES}
    chosen = {k: v for k, v in fields.items() if k in FEATURE_NAMES}
    if chosen:
        out["features"] = dataclasses.replace(out.get("features", ModelFeatures()), **chosen)
    return out


def config_value(c, name: str):
    """``c.features.<name>`` for a ``ModelFeatures`` field, else ``c.<name>`` (the reader of ``nest_features``)."""
    return getattr(c.features if name in FEATURE_NAMES else c, name)


def check_features(c) -> None:
    """The checks of ``c.features`` against the rest of config ``c``."""
    f = c.features
    if not isinstance(f, ModelFeatures):
        raise TypeError(f"features must be a ringsplash.model.ModelFeatures, got {type(f).__name__} {f!r}")
    if f.rope_scaling is not None:
        check_rope_dim(f.rope_scaling, c.head_dim)
    if f.layer_types is not None and len(f.layer_types) != c.num_layers:
        raise ValueError(f"layer_types must have one entry per layer: num_layers={c.num_layers}, "
                         f"got {len(f.layer_types)} (layer_types={f.layer_types!r})")
    if c.qk_clip_threshold is not None and (f.qk_norm or f.attention_bias):
        raise ValueError(f"qk_clip_threshold={c.qk_clip_threshold} rescales W_q / W_k, which cannot bound the logits "
                         f"with qk_norm={f.qk_norm} / attention_bias={f.attention_bias}: set qk_clip_threshold=None")


def layer_segments(layer_types: tuple[str, ...] | None, num_layers: int) -> tuple[LayerSegment, ...]:
    """How the layer stack is scanned, with a program size independent of depth for periodic patterns.

    None: one scan over every layer. Otherwise the shortest period ``p`` of the pattern: one scan of
    ``num_layers // p`` steps of ``p`` layers, then one step of the ``num_layers % p`` remaining layers
    (Gemma 3 1B: 26 = 4 x 6 + 2). A pattern with no repeat (``p == num_layers``) is scanned run by run
    of equal types instead (e.g. Qwen2's full layers then sliding ones)."""
    if layer_types is None:
        return (LayerSegment(0, num_layers, (None,)),)
    n = num_layers
    p = next(p for p in range(1, n + 1) if all(layer_types[i] == layer_types[i % p] for i in range(n)))
    if p < n:
        segments = [LayerSegment(0, n // p, tuple(layer_types[:p]))]
        if n % p:
            segments.append(LayerSegment(n // p * p, 1, tuple(layer_types[: n % p])))
        return tuple(segments)
    segments, start = [], 0
    for i in range(1, n + 1):
        if i == n or layer_types[i] != layer_types[start]:
            segments.append(LayerSegment(start, i - start, (layer_types[start],)))
            start = i
    return tuple(segments)


__all__ = ["FEATURE_NAMES", "LAYER_TYPES", "MLP_ACTIVATIONS", "LayerSegment", "LayerType", "MlpActivation",
           "ModelFeatures", "check_features", "config_value", "layer_segments", "nest_features"]
