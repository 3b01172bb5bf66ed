"""RoPE scaling (linear, dynamic NTK, YaRN, Llama 3, LongRoPE) with Hugging Face's numerics.

``RopeScaling`` is the frozen, hashable, JSON-able record of one scaling scheme, read from and
written to a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict (``from_hf`` / ``to_hf``).
``rope_inv_freq`` and ``rope_attention_factor`` compute, on the host in numpy, what
transformers' ``ROPE_INIT_FUNCTIONS`` compute: the float32 inverse frequencies
``[dim // 2]`` and the multiplier of cos / sin (YaRN's mscale, LongRoPE's attention factor).

Numerics. Every float32 step of transformers' formulas is repeated in float32 in the same order
(the scalar arithmetic in Python floats, as there), and ``base ** exponent`` is the float64
power rounded to float32. That is what torch's scalar ``pow`` gives; torch's vectorised CPU
``pow`` (SLEEF, 1-ulp accurate) differs from it by one float32 ulp on about 1% of the elements,
so a result may differ from transformers' by one ulp there (tests/test_rope.py measures it).

"Current length" (``seq_len``), which only ``dynamic`` and ``longrope`` read, is the length
transformers sees in a forward pass: ``max(position_ids) + 1``. For a full-sequence forward (and
in training) over positions ``0 .. S - 1`` that is ``S``, the static (global) sequence length of
the call, and that is what the model passes (``Attention``: the local length times the context
shards, capped at ``max_seq_len``: only the padding ``train.layout_batch`` adds for a
context-parallel strategy runs past it, and it must not change the frequencies), so the
frequencies are compile-time constants and every shard of a sequence-parallel call uses the same
ones. (A packed batch whose positions restart per document would make
transformers use the longest document's length instead; here it stays ``S``.)

Decoding (not implemented yet): transformers recomputes ``max(position_ids) + 1`` on every
call, i.e. the cached length plus the new tokens, and keeps the keys already in the cache as
they were rotated; ``dynamic`` additionally only grows its length (it keeps the longest length
seen until a call falls back under ``original_max_position_embeddings``), and ``longrope``
switches every position to the long factors once the total length passes
``original_max_position_embeddings``.

``dynamic``'s ``original_max_position_embeddings`` is transformers' ``max_position_embeddings``
(the length the model was trained at, which the dynamic formula divides by); a Hugging Face
``rope_scaling`` dict of type ``dynamic`` does not carry it, so ``from_hf`` takes it from the
``max_position_embeddings`` argument and ``to_hf`` leaves it out (it belongs in config.json's
``max_position_embeddings``).
"""

import dataclasses
import math
from typing import Any, Literal

import numpy as np

from ringsplash._internal import caches
from ringsplash._internal.scalar_checks import (
    check_bool,
    check_choice,
    check_float,
    check_positive_int,
    literal_choices,
)

RopeType = Literal["default", "linear", "dynamic", "yarn", "llama3", "longrope"]
ROPE_TYPES: tuple[str, ...] = literal_choices(RopeType)

#: the fields each type needs (besides ``type``) and the optional ones it also accepts; every other
#: field must stay None
_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": ("factor", "original_max_position_embeddings", "short_factor", "long_factor"),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
    "longrope": ("attention_factor",),
}
#: the two spellings of the type in Hugging Face dicts
_HF_TYPE_KEYS = ("rope_type", "type")

_FLOAT_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor")


def _check_field(name: str, value: Any) -> Any:
    """One ``RopeScaling`` field's value (not None), checked and normalised: floats for the
    numbers, an int length, a bool ``truncate``, tuples of positive floats for the LongRoPE factors."""
    if name in _FLOAT_FIELDS:
        return check_float(name, value, positive=True)
    if name in ("mscale", "mscale_all_dim"):
        return check_float(name, value, minimum=0.0)
    if name == "original_max_position_embeddings":
        return check_positive_int(name, value)
    if name == "truncate":
        return check_bool(name, value)  # np.bool_ too (was refused), kept as a Python bool
    # short_factor / long_factor
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__") or not len(value):
        raise ValueError(f"{name} must be a non-empty sequence of numbers, got {name}={value!r}")
    return tuple(check_float(f"{name}[{i}]", v, positive=True) for i, v in enumerate(value))


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """One RoPE scaling scheme, as Hugging Face's ``rope_scaling`` / ``rope_parameters`` describe it.

    * ``"default"`` — plain RoPE, with transformers' numerics (``1 / theta ** (2i / d)``; the model's
      ``rope_scaling=None`` keeps ringsplash's own formula ``theta ** (-2i / d)``, which can differ
      from it by a float32 ulp);
    * ``"linear"`` — position interpolation: frequencies divided by ``factor``;
    * ``"dynamic"`` — dynamic NTK: past ``original_max_position_embeddings`` the base grows with the
      current length (module docstring);
    * ``"yarn"`` — YaRN: a ramp between interpolated and extrapolated frequencies set by
      ``beta_fast`` / ``beta_slow`` (default 32 / 1; ``truncate``, default True, floors / ceils the
      ramp's ends), cos / sin scaled by ``attention_factor`` (default: the paper's mscale from
      ``factor``, or the ratio of the ``mscale`` and ``mscale_all_dim`` ones when both are set);
    * ``"llama3"`` — Llama 3.1: low frequencies divided by ``factor``, high ones kept, a smooth
      blend between (``low_freq_factor`` / ``high_freq_factor``);
    * ``"longrope"`` — LongRoPE / Phi-3: per-frequency ``short_factor`` (current length up to
      ``original_max_position_embeddings``) or ``long_factor`` (longer), cos / sin scaled by
      ``attention_factor`` (default ``sqrt(1 + log(factor) / log(original_max_position_embeddings))``,
      1 when ``factor <= 1``).

    Fields of another type must stay None (a ``ValueError`` names them); the ones a type needs must
    be set. ``short_factor`` / ``long_factor`` are stored as tuples of floats.
    """

    type: RopeType = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    # yarn
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    # yarn, longrope
    attention_factor: float | None = None
    # longrope
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.type not in ROPE_TYPES:
            raise ValueError(f"RopeScaling type={self.type!r} is not supported: use one of {ROPE_TYPES}")
        needed, optional = _REQUIRED[self.type], _OPTIONAL.get(self.type, ())
        for f in dataclasses.fields(self):
            if f.name == "type":
                continue
            value = getattr(self, f.name)
            if f.name in needed and value is None:
                raise ValueError(f"RopeScaling(type={self.type!r}) needs {f.name} (one of its fields: "
                                 f"{needed + optional})")
            if f.name not in needed + optional and value is not None:
                users = [t for t in ROPE_TYPES if f.name in _REQUIRED[t] + _OPTIONAL.get(t, ())]
                raise ValueError(f"RopeScaling {f.name}={value!r} only applies to type in {tuple(users)}, "
                                 f"not type={self.type!r}: leave it None")
        for f in dataclasses.fields(self):
            if f.name != "type" and getattr(self, f.name) is not None:
                self._set(f.name, _check_field(f.name, getattr(self, f.name)))
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"RopeScaling(type='llama3') needs high_freq_factor > low_freq_factor, got "
                             f"high_freq_factor={self.high_freq_factor}, low_freq_factor={self.low_freq_factor}")
        if self.type == "yarn" and self.beta_fast is not None and self.beta_slow is not None \
                and self.beta_fast < self.beta_slow:
            raise ValueError(f"RopeScaling(type='yarn') needs beta_fast >= beta_slow, got "
                             f"beta_fast={self.beta_fast}, beta_slow={self.beta_slow}")
        if self.type == "longrope" and len(self.short_factor) != len(self.long_factor):
            raise ValueError(f"short_factor and long_factor must have the same length (head_dim // 2), got "
                             f"{len(self.short_factor)} and {len(self.long_factor)}")

    def _set(self, name: str, value: Any) -> None:  # normalising in __post_init__ of a frozen dataclass
        object.__setattr__(self, name, value)

    @classmethod
    def from_dict(cls, d: dict) -> "RopeScaling":
        """The inverse of ``dataclasses.asdict`` after a JSON round trip (lists back to tuples,
        integral floats accepted as ints where JSON wrote them so), e.g. from a run's config.json."""
        d = dict(d)
        rope_type = d.pop("type", "default")
        return cls(type=rope_type, **{k: None if v is None else _check_field(k, v) for k, v in d.items()})

    # ------------------------------------------------------------------ Hugging Face dicts

    @classmethod
    def from_hf(cls, d: dict, *, max_position_embeddings: int | None = None,
                original_max_position_embeddings: int | None = None,
                rope_theta: float | None = None) -> "RopeScaling":
        """The scheme of a Hugging Face ``rope_scaling`` dict or the newer ``rope_parameters`` one
        (the type under ``rope_type`` or the older ``type``; a null value counts as absent).

        The config.json values transformers reads next to the dict: ``max_position_embeddings``
        (``dynamic``'s length; the default of ``original_max_position_embeddings``; ``factor`` of
        ``yarn`` / ``longrope`` when absent = ``max_position_embeddings /
        original_max_position_embeddings``) and a top-level ``original_max_position_embeddings``
        (Phi-3 style), which wins over the dict's for ``yarn`` / ``llama3`` / ``longrope`` as it
        does in transformers. A ``rope_theta`` in the dict must equal the ``rope_theta`` argument
        (the model's ``TransformerConfig.rope_theta``, which the caller sets); ``partial_rotary_factor``
        other than 1 and any other key raise a ``ValueError`` naming them."""
        if not isinstance(d, dict):
            raise TypeError(f"RopeScaling.from_hf takes a dict, got {type(d).__name__}")
        d = {k: v for k, v in d.items() if v is not None}
        types = {d[k] for k in _HF_TYPE_KEYS if k in d}
        if len(types) > 1:
            raise ValueError(f"rope dict has rope_type={d['rope_type']!r} and type={d['type']!r}: they must agree")
        rope_type = types.pop() if types else "default"
        check_choice("rope_type", rope_type, ROPE_TYPES)
        if "rope_theta" in d and (rope_theta is None or float(d["rope_theta"]) != float(rope_theta)):
            raise ValueError(f"rope dict has rope_theta={d['rope_theta']!r} but rope_theta={rope_theta!r} was "
                             f"passed: pass the same (the model's TransformerConfig.rope_theta)")
        if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"partial_rotary_factor={d['partial_rotary_factor']!r} is not supported (RoPE over "
                             f"the whole head only): it must be 1.0 or absent")
        fields = {f.name for f in dataclasses.fields(cls)} - {"type"}
        known = set(_HF_TYPE_KEYS) | {"rope_theta", "partial_rotary_factor"}
        unknown = sorted(set(d) - fields - known)
        if unknown:
            raise ValueError(f"rope dict of type {rope_type!r} has keys {unknown} that RopeScaling does not "
                             f"understand (fields: {sorted(fields)}); refusing to build a different model")
        # JSON numbers normalised first (ints for float fields, lists for tuples), with the field's checks
        values = {k: _check_field(k, v) for k, v in d.items() if k in fields}
        if rope_type == "dynamic":
            if "original_max_position_embeddings" in values:
                raise ValueError("a Hugging Face rope dict of type 'dynamic' has no original_max_position_embeddings "
                                 "(transformers ignores it and uses max_position_embeddings): remove it and pass "
                                 "max_position_embeddings")
            if max_position_embeddings is None:
                raise ValueError("rope_type='dynamic' needs max_position_embeddings (config.json's, the length "
                                 "the dynamic base is scaled from)")
            values["original_max_position_embeddings"] = max_position_embeddings
        if rope_type in ("yarn", "llama3", "longrope"):
            if original_max_position_embeddings is not None:
                values["original_max_position_embeddings"] = original_max_position_embeddings
            elif "original_max_position_embeddings" not in values and max_position_embeddings is not None:
                values["original_max_position_embeddings"] = max_position_embeddings
        if rope_type in ("yarn", "longrope") and "factor" not in values:
            omax = values.get("original_max_position_embeddings")
            if max_position_embeddings is None or omax is None:
                raise ValueError(f"rope_type={rope_type!r} without factor needs max_position_embeddings and "
                                 f"original_max_position_embeddings (factor = their ratio)")
            values["factor"] = max_position_embeddings / omax
        return cls(type=rope_type, **values)

    def to_hf(self, *, rope_theta: float | None = None) -> dict:
        """The Hugging Face dict (``rope_type`` and the fields that are set; lists for the LongRoPE
        factors; with ``rope_theta`` also that key, the ``rope_parameters`` shape). ``dynamic``'s
        ``original_max_position_embeddings`` is left out: it is config.json's ``max_position_embeddings``."""
        d: dict[str, Any] = {"rope_type": self.type}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "type" or value is None:
                continue
            if self.type == "dynamic" and f.name == "original_max_position_embeddings":
                continue
            d[f.name] = list(value) if isinstance(value, tuple) else value
        if rope_theta is not None:
            d["rope_theta"] = float(rope_theta)
        return d


# ---------------------------------------------------------------------- frequencies

_f32 = np.float32


def _pow(base, exponent) -> np.ndarray:
    """float32 ``base ** exponent`` as the float64 power rounded once (torch's scalar ``pow``)."""
    return (np.float64(_f32(base)) ** np.asarray(exponent, np.float32).astype(np.float64)).astype(np.float32)


def _default_inv_freq(dim: int, base: float | np.floating) -> np.ndarray:
    """transformers' ``1 / base ** (arange(0, dim, 2) / dim)`` in float32."""
    exponent = np.arange(0, dim, 2).astype(np.float32) / _f32(dim)
    return _f32(1.0) / _pow(base, exponent)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(s: RopeScaling, dim: int, base: float) -> np.ndarray:
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1
    omax = s.original_max_position_embeddings

    def correction_dim(rotations):
        return (dim * math.log(omax / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate is None or s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - _f32(low)) / _f32(high - low), _f32(0), _f32(1))
    extrapolation = _f32(1) - ramp  # weight of the unscaled frequencies
    pos_freqs = _pow(base, np.arange(0, dim, 2).astype(np.float32) / _f32(dim))
    inv_extrapolated = _f32(1.0) / pos_freqs
    inv_interpolated = _f32(1.0) / (_f32(s.factor) * pos_freqs)
    return inv_interpolated * (_f32(1) - extrapolation) + inv_extrapolated * extrapolation


def _llama3_inv_freq(s: RopeScaling, dim: int, base: float) -> np.ndarray:
    inv_freq = _default_inv_freq(dim, base)
    omax, low, high, factor = s.original_max_position_embeddings, s.low_freq_factor, s.high_freq_factor, s.factor
    low_wavelen, high_wavelen = _f32(omax / low), _f32(omax / high)
    # torch evaluates ``number / tensor`` as ``tensor.reciprocal() * number``
    wavelen = (_f32(1) / inv_freq) * _f32(2 * math.pi)
    scaled = np.where(wavelen > low_wavelen, inv_freq / _f32(factor), inv_freq)
    smooth = ((_f32(1) / wavelen) * _f32(omax) - _f32(low)) / _f32(high - low)
    smoothed = (_f32(1) - smooth) * scaled / _f32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def _dynamic_base(s: RopeScaling, dim: int, base: float, seq_len: int) -> float | np.floating:
    """The dynamic-NTK base at ``seq_len``: up to ``original_max_position_embeddings``, the one
    transformers computes at construction (Python floats); beyond, the one its forward pass
    computes from ``max(position_ids) + 1``, a tensor, hence in float32."""
    factor, omax = s.factor, s.original_max_position_embeddings
    if seq_len <= omax:
        return base * ((factor * omax / omax) - (factor - 1)) ** (dim / (dim - 2))
    t = _f32(factor) * _f32(seq_len) / _f32(omax) - _f32(factor - 1)
    # torch's ``tensor ** number`` keeps the exponent in float64
    return _f32(base) * _f32(np.float64(t) ** (dim / (dim - 2)))


@caches.lru_cache(maxsize=256)
def _inv_freq_cached(s: RopeScaling, dim: int, theta: float, seq_len: int | None) -> np.ndarray:
    if s.type == "default":
        out = _default_inv_freq(dim, theta)
    elif s.type == "linear":
        out = _default_inv_freq(dim, theta) / _f32(s.factor)
    elif s.type == "dynamic":
        out = _default_inv_freq(dim, _dynamic_base(s, dim, theta, seq_len))
    elif s.type == "yarn":
        out = _yarn_inv_freq(s, dim, theta)
    elif s.type == "llama3":
        out = _llama3_inv_freq(s, dim, theta)
    else:  # longrope
        factors = s.long_factor if seq_len > s.original_max_position_embeddings else s.short_factor
        shape = np.arange(0, dim, 2).astype(np.float32) / _f32(dim)
        out = _f32(1.0) / (np.asarray(factors, np.float32) * _pow(theta, shape))
    out = np.asarray(out, np.float32)
    out.setflags(write=False)
    return out


def check_rope_dim(scaling: RopeScaling, dim: int) -> int:
    """``dim`` (the rotary dimension: the head dim) as an even positive int that fits ``scaling``."""
    dim = check_positive_int("dim", dim)
    if dim % 2:
        raise ValueError(f"the rotary dimension must be even (RoPE rotates pairs), got dim={dim}")
    if scaling.type == "dynamic" and dim < 4:
        raise ValueError(f"RopeScaling(type='dynamic') needs a rotary dimension >= 4 (its base exponent is "
                         f"dim / (dim - 2)), got dim={dim}")
    if scaling.type == "longrope" and len(scaling.short_factor) != dim // 2:
        raise ValueError(f"RopeScaling(type='longrope') has {len(scaling.short_factor)} short / long factors but "
                         f"the rotary dimension {dim} needs dim // 2 = {dim // 2}")
    return dim


def rope_inv_freq(scaling: RopeScaling, dim: int, theta: float, *, seq_len: int | None = None) -> np.ndarray:
    """float32 inverse frequencies ``[dim // 2]`` of ``scaling`` for rotary dimension ``dim`` (the
    head dim) and base ``theta``, as transformers' ``ROPE_INIT_FUNCTIONS`` (module docstring:
    numerics). ``seq_len``: the current length (module docstring), needed by ``dynamic`` and
    ``longrope`` and ignored by the others. A read-only numpy array (cached)."""
    if not isinstance(scaling, RopeScaling):
        raise TypeError(f"scaling must be a RopeScaling, got {type(scaling).__name__}")
    dim = check_rope_dim(scaling, dim)
    theta = check_float("theta", theta, positive=True)
    if scaling.type in ("dynamic", "longrope"):
        if seq_len is None:
            raise ValueError(f"RopeScaling(type={scaling.type!r}) needs seq_len (the current sequence length)")
        seq_len = check_positive_int("seq_len", seq_len)
    else:
        seq_len = None
    return _inv_freq_cached(scaling, dim, theta, seq_len)


def rope_attention_factor(scaling: RopeScaling) -> float:
    """The multiplier of cos and sin (transformers' ``attention_scaling``): YaRN's and LongRoPE's
    ``attention_factor`` or its default (``RopeScaling``), 1 for the other types."""
    if not isinstance(scaling, RopeScaling):
        raise TypeError(f"scaling must be a RopeScaling, got {type(scaling).__name__}")
    s = scaling
    if s.type == "yarn":
        if s.attention_factor is not None:
            return s.attention_factor
        if s.mscale and s.mscale_all_dim:
            return float(_yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim))
        return _yarn_mscale(s.factor)
    if s.type == "longrope":
        if s.attention_factor is not None:
            return s.attention_factor
        if s.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))
    return 1.0


#: the ``rope_scaling`` types command-line flags can build (LongRoPE needs per-frequency factors)
FLAG_ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")


def rope_scaling_from_flags(kind: str, factor: float = 0.0, original_max_len: int = 0) -> RopeScaling | None:
    """The ``RopeScaling`` of the experiments' ``--rope-scaling TYPE --rope-factor F
    --rope-original-max-len N`` flags (``""``: None, and then the other two must stay 0). ``yarn``
    takes transformers' defaults, ``llama3`` Llama 3.1's ``low_freq_factor=1``, ``high_freq_factor=4``;
    ``dynamic`` / ``yarn`` / ``llama3`` need ``N``, the length the model was (pre)trained at."""
    if not kind:
        if factor or original_max_len:
            raise ValueError(f"--rope-factor={factor} / --rope-original-max-len={original_max_len} need "
                             f"--rope-scaling (one of {FLAG_ROPE_TYPES})")
        return None
    if kind not in FLAG_ROPE_TYPES:
        raise ValueError(f"--rope-scaling={kind!r}: use one of {FLAG_ROPE_TYPES} (or '' for none)")
    if factor <= 0:
        raise ValueError(f"--rope-scaling={kind} needs --rope-factor > 0, got {factor}")
    fields: dict[str, Any] = {"factor": float(factor)}
    if kind != "linear":
        if original_max_len <= 0:
            raise ValueError(f"--rope-scaling={kind} needs --rope-original-max-len (the length the model was trained "
                             f"at), got {original_max_len}")
        fields["original_max_position_embeddings"] = int(original_max_len)
    elif original_max_len:
        raise ValueError("--rope-original-max-len does not apply to --rope-scaling=linear: leave it 0")
    if kind == "llama3":
        fields.update(low_freq_factor=1.0, high_freq_factor=4.0)
    return RopeScaling(type=kind, **fields)


__all__ = ["FLAG_ROPE_TYPES", "ROPE_TYPES", "RopeScaling", "RopeType", "check_rope_dim", "rope_attention_factor",
           "rope_inv_freq", "rope_scaling_from_flags"]
