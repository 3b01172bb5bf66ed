"""The ``TransformerConfig`` options Hugging Face families need (Llama, Mistral, Qwen2/3, Gemma 2/3):
their validation, and how a per-layer attention pattern (``layer_types``) is cut into scanned segments.

Sliding-window convention (transformers' ``sliding_window_overlay``): a query at ``q`` sees the keys
``k`` with ``0 <= q - k < sliding_window``, i.e. itself and the ``sliding_window - 1`` previous
tokens, which is ringsplash's ``LocalMask(window=(sliding_window - 1, 0))``, or ``mask="local"``
with ``local_window = sliding_window - 1`` (what a Mistral checkpoint maps to).
"""

from typing import Literal, NamedTuple

from ringsplash._scalar_checks import check_choice, check_float, check_positive_int, literal_choices

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


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {name}={value!r} ({type(value).__name__})")


def check_hf_features(c) -> None:
    """Validate (and normalise: ``layer_types`` to a tuple) the Hugging Face family options of config ``c``."""
    if c.intermediate_size is not None:
        check_positive_int("intermediate_size", c.intermediate_size)
    check_choice("mlp_activation", c.mlp_activation, MLP_ACTIVATIONS)
    for name in ("attention_bias", "qk_norm", "post_norms", "scale_embeddings"):
        _check_bool(name, getattr(c, name))
    check_float("norm_eps", c.norm_eps, positive=True)
    check_float("norm_offset", c.norm_offset)
    for name in ("attention_scale", "final_logit_soft_cap"):
        if getattr(c, name) is not None:
            check_float(name, getattr(c, name), positive=True)
    sliding = _check_layer_types(c)
    if c.sliding_window is not None:
        check_positive_int("sliding_window", c.sliding_window)
        if not sliding:
            raise ValueError(f"sliding_window={c.sliding_window!r} only applies to layer_types with a "
                             f"'sliding_attention' layer (layer_types={c.layer_types!r}): set sliding_window=None, "
                             f"or for one window on every layer use mask='local', local_window=sliding_window - 1")
    elif sliding:
        raise ValueError("layer_types has 'sliding_attention' layers, which need sliding_window=<int > 0> "
                         "(tokens a query sees, itself included, as in Hugging Face), got sliding_window=None")
    if c.local_rope_theta is not None:
        check_float("local_rope_theta", c.local_rope_theta, positive=True)
        if not sliding:
            raise ValueError(f"local_rope_theta={c.local_rope_theta!r} is the RoPE base of 'sliding_attention' "
                             f"layers, and layer_types={c.layer_types!r} has none: set local_rope_theta=None")
    if c.qk_clip_threshold is not None and (c.qk_norm or c.attention_bias):
        raise ValueError(f"qk_clip_threshold={c.qk_clip_threshold} rescales W_q / W_k, which cannot bound the logits "
                         f"with qk_norm={c.qk_norm} / attention_bias={c.attention_bias}: set qk_clip_threshold=None")


def _check_layer_types(c) -> bool:
    """Whether ``c.layer_types`` (None or one known type per layer) has a sliding layer."""
    if c.layer_types is None:
        return False
    if isinstance(c.layer_types, str) or not isinstance(c.layer_types, tuple | list):
        raise ValueError(f"layer_types must be None or a sequence of {LAYER_TYPES} per layer, "
                         f"got layer_types={c.layer_types!r}")
    object.__setattr__(c, "layer_types", tuple(c.layer_types))  # JSON lists back to a (hashable) tuple
    if len(c.layer_types) != c.num_layers:
        raise ValueError(f"layer_types must have one entry per layer: num_layers={c.num_layers}, "
                         f"got {len(c.layer_types)} (layer_types={c.layer_types!r})")
    for t in c.layer_types:
        if t not in LAYER_TYPES:
            raise ValueError(f"layer_types entries must be one of {LAYER_TYPES}, got {t!r} in layer_types")
    return SLIDING in c.layer_types


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


__all__ = ["LAYER_TYPES", "MLP_ACTIVATIONS", "LayerSegment", "LayerType", "MlpActivation", "check_hf_features",
           "layer_segments"]
