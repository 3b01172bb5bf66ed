"""The parts of a Hugging Face family that differ between families, each both directions.

A ``Feature`` owns some ``TransformerConfig`` fields (``fields``, by their flat names: those of
``ModelFeatures`` live in ``TransformerConfig.features``, ``model.hf_features.config_value``) and
converts them: ``read(d, get)``
gives their values from a config.json dict (``get(key)``: the value, or the family's default where
the file leaves the key out); ``write(c, d)`` gives the config.json keys that record them (``d``:
the dict written so far, which a feature may rewrite); ``mismatches(c)`` names what the family
cannot express. ``normalise(d)`` reshapes a config.json before anything reads it (Gemma 3's
per-layer-type ``rope_parameters``). A family (``families.py``) is a list of features plus the
fields it fixes; adding a family seldom needs a new feature here.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

from ringsplash.model.config import TransformerConfig
from ringsplash.model.hf_features import config_value

#: ``get(key)``: config.json's value of ``key``, or the family's default where the file leaves it out
Getter = Callable[[str], Any]
FULL, SLIDING = "full_attention", "sliding_attention"


def refuse(key: str, value: Any, why: str) -> None:
    """A ``ValueError`` naming the config.json key and value that would build a different model."""
    raise ValueError(f"config.json has {key}={value!r}, which {why}; refusing to load a different model")


class Feature:
    """One convertible part of a family (see the module docstring); the defaults convert nothing."""

    fields: tuple[str, ...] = ()

    def normalise(self, d: dict) -> dict:
        return d

    def read(self, d: dict, get: Getter) -> dict:
        return {}

    def write(self, c: TransformerConfig, d: dict) -> dict:
        return {}

    def mismatches(self, c: TransformerConfig) -> list[str]:
        return []


@dataclasses.dataclass(frozen=True)
class Key(Feature):
    """A config.json key that is a ``TransformerConfig`` field as-is (None: off), e.g. Gemma's
    ``final_logit_softcapping`` → ``final_logit_soft_cap``."""

    field: str
    key: str

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.field,)

    def read(self, d: dict, get: Getter) -> dict:
        return {self.field: get(self.key)}

    def write(self, c: TransformerConfig, d: dict) -> dict:
        return {self.key: config_value(c, self.field)}


@dataclasses.dataclass(frozen=True)
class Activation(Feature):
    """The MLP's activation: config.json's ``keys`` (the first one set wins) must hold one of
    ``accepted`` (``accepted[0]`` is written, and assumed where absent); ours is ``mlp_activation``."""

    ours: str
    keys: tuple[str, ...]
    accepted: tuple[str, ...]
    what: str  # for the refusal: "the SwiGLU", "gemma's tanh-approximated GeLU"
    fields: tuple[str, ...] = ("mlp_activation",)

    def read(self, d: dict, get: Getter) -> dict:
        key = next((k for k in self.keys if d.get(k) is not None), self.keys[0])
        act = d.get(key, self.accepted[0])
        if act not in self.accepted:
            refuse(key, act, f"is not {self.what} ({key} {self.accepted[0]!r})")
        return {"mlp_activation": self.ours}

    def write(self, c: TransformerConfig, d: dict) -> dict:
        return {self.keys[0]: self.accepted[0]}

    def mismatches(self, c: TransformerConfig) -> list[str]:
        act = c.features.mlp_activation
        return [] if act == self.ours else [f"mlp_activation={act!r} (the family has {self.ours!r})"]


@dataclasses.dataclass(frozen=True)
class QueryScale(Feature):
    """Gemma's softmax scale ``query_pre_attn_scalar ** -0.5`` (``attention_scale``)."""

    fields: tuple[str, ...] = ("attention_scale",)

    def read(self, d: dict, get: Getter) -> dict:
        return {"attention_scale": float(get("query_pre_attn_scalar")) ** -0.5}

    def write(self, c: TransformerConfig, d: dict) -> dict:
        scalar = (c.features.attention_scale or c.head_dim**-0.5) ** -2
        if abs(scalar - round(scalar)) < 1e-6 * scalar:
            scalar = round(scalar)  # transformers' field is an int
        return {"query_pre_attn_scalar": scalar}


@dataclasses.dataclass(frozen=True)
class UniformWindow(Feature):
    """Mistral's ``sliding_window`` on every layer: ``mask="local"`` with ``local_window =
    sliding_window - 1`` (a query sees itself and the ``sliding_window - 1`` tokens before it)."""

    fields: tuple[str, ...] = ("mask", "local_window")

    def read(self, d: dict, get: Getter) -> dict:
        window = get("sliding_window")
        return {} if window is None else {"mask": "local", "local_window": int(window) - 1}

    def write(self, c: TransformerConfig, d: dict) -> dict:
        return {"sliding_window": c.local_window + 1 if c.mask == "local" else None}

    def mismatches(self, c: TransformerConfig) -> list[str]:
        ok = isinstance(c.mask, str) and c.mask in ("causal", "local")
        return [] if ok else [f"mask={c.mask!r} (the family has 'causal' or 'local')"]


@dataclasses.dataclass(frozen=True)
class LayerTypes(Feature):
    """Per-layer full / sliding attention (``layer_types``, ``sliding_window``), from config.json's
    ``layer_types`` or, where absent, the family's rule ``default(d, get, num_layers, window)``."""

    default: Callable[[dict, Getter, int, Any], list[str]]
    fields: tuple[str, ...] = ("layer_types", "sliding_window")

    def window(self, d: dict, get: Getter):
        return get("sliding_window")

    def read(self, d: dict, get: Getter) -> dict:
        num_layers, window = d["num_hidden_layers"], self.window(d, get)
        types = d.get("layer_types")
        types = tuple(self.default(d, get, num_layers, window) if types is None else types)
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers={num_layers}")
        bad = sorted(set(types) - {FULL, SLIDING})
        if bad:
            raise ValueError(f"layer_types has {bad}: supported are {FULL!r} and {SLIDING!r}")
        if SLIDING in types and not window:
            raise ValueError(f"layer_types has sliding layers but sliding_window={window!r}")
        if SLIDING not in types:
            return {"layer_types": None, "sliding_window": None}
        return {"layer_types": types, "sliding_window": int(window)}

    def write(self, c: TransformerConfig, d: dict) -> dict:
        types = list(c.features.layer_types) if c.features.layer_types else [FULL] * c.num_layers
        return {"layer_types": types, "sliding_window": c.features.sliding_window}


@dataclasses.dataclass(frozen=True)
class QwenLayerTypes(LayerTypes):
    """Qwen's: the window applies only with ``use_sliding_window``; config.json also records the
    first sliding layer (``max_window_layers``), from which transformers derives absent ``layer_types``."""

    def window(self, d: dict, get: Getter):
        return get("sliding_window") if get("use_sliding_window") else None

    def write(self, c: TransformerConfig, d: dict) -> dict:
        types = c.features.layer_types
        first = types.index(SLIDING) if types else c.num_layers
        return {**super().write(c, d), "use_sliding_window": bool(types), "max_window_layers": first}


def from_max_window_layers(d: dict, get: Getter, num_layers: int, window) -> list[str]:
    """Qwen: sliding from layer ``max_window_layers`` on (when there is a window), full before."""
    first = get("max_window_layers")
    return [SLIDING if window is not None and i >= first else FULL for i in range(num_layers)]


def alternating(d: dict, get: Getter, num_layers: int, window) -> list[str]:
    """Gemma 2: even layers sliding, odd ones full."""
    return [SLIDING if not i % 2 else FULL for i in range(num_layers)]


def every_nth_full(d: dict, get: Getter, num_layers: int, window) -> list[str]:
    """Gemma 3: every ``sliding_window_pattern``-th layer full (6 where absent), the others sliding."""
    pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]


@dataclasses.dataclass(frozen=True)
class LocalRope(Feature):
    """Gemma 3's plain RoPE of the sliding layers (``local_rope_theta``): config.json's
    ``rope_local_base_freq``, or ``rope_parameters`` per layer type (``full_attention``: the model's
    RoPE, ``sliding_attention``: plain, with its own ``rope_theta``)."""

    fields: tuple[str, ...] = ("local_rope_theta",)

    def normalise(self, d: dict) -> dict:
        params = d.get("rope_parameters")
        if not (isinstance(params, dict) and (FULL in params or SLIDING in params)):
            return d
        unknown = sorted(set(params) - {FULL, SLIDING})
        if unknown:
            raise ValueError(f"rope_parameters has layer types {unknown}: gemma3 has {FULL} and {SLIDING} only")
        local = dict(params.get(SLIDING) or {})
        out = {**d, "rope_parameters": params.get(FULL)}
        if "rope_theta" in local:
            out["rope_local_base_freq"] = local.pop("rope_theta")
        kind = local.pop("rope_type", local.pop("type", "default"))
        if kind != "default" or local:
            raise ValueError(f"rope_parameters['{SLIDING}'] = {params[SLIDING]!r}: the sliding layers' RoPE must be "
                             f"plain (rope_type 'default', rope_theta), got rope_type={kind!r}"
                             f"{' and ' + str(sorted(local)) if local else ''}")
        return out

    def read(self, d: dict, get: Getter) -> dict:
        return {"local_rope_theta": float(get("rope_local_base_freq"))}

    def write(self, c: TransformerConfig, d: dict) -> dict:
        local = {"rope_type": "default", "rope_theta": float(c.features.local_rope_theta)}
        return {"rope_parameters": {FULL: d["rope_parameters"], SLIDING: local}}

    def mismatches(self, c: TransformerConfig) -> list[str]:
        return [] if c.features.local_rope_theta is not None else [
            "local_rope_theta=None (the family's sliding layers have a RoPE base of their own)"]


__all__ = ["FULL", "SLIDING", "Activation", "Feature", "Getter", "Key", "LayerTypes", "LocalRope", "QueryScale",
           "QwenLayerTypes", "UniformWindow", "alternating", "every_nth_full", "from_max_window_layers",
           "refuse"]
