"""``TransformerConfig``: every hyperparameter of the model, validated once at construction.

A config that constructs is a config that runs: each rejected combination raises a
``ValueError`` naming the option and the fix, never an error deep inside a traced call.
"""

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Literal

from ringsplash import masks as masks_lib
from ringsplash._internal import caches
from ringsplash._internal.scalar_checks import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_positive_int,
    literal_choices,
    plain_fields,
)
from ringsplash.model import _legacy
from ringsplash.model.hf_features import LAYER_TYPES, SLIDING, ModelFeatures, check_features
from ringsplash.model.parallelism import RING_AXIS_STRATEGIES, STRATEGIES, ULYSSES_AXIS_STRATEGIES, ContextParallel
from ringsplash.model.rope_scaling import RopeScaling
from ringsplash.splash.config import NUM_LANES, SplashConfig

MaskKind = Literal["causal", "local", "chunked", "prefix_lm", "full"]
DType = Literal["float32", "bfloat16", "float16"]
MASKS: tuple[str, ...] = literal_choices(MaskKind)
DTYPES: tuple[str, ...] = literal_choices(DType)
#: ``remat`` policies for the scanned layer step (see ``ringsplash.model.transformer.remat_policy``):
#: ``"none"`` saves every residual, ``"full"`` saves only the layer input and recomputes the layer,
#: ``"save_attention"`` saves the attention outputs (and their log-sum-exp) so the backward pass
#: recomputes the projections and the MLP but never the attention, ``"save_dots"`` saves every
#: matmul result without batch dimensions plus the attention outputs.
RematPolicy = Literal["none", "full", "save_attention", "save_dots"]
REMAT_POLICIES: tuple[str, ...] = literal_choices(RematPolicy)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Decoder-only transformer: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

    ``context_parallel`` (a ``ContextParallel``) is the attention strategy and its context
    parallelism: ``"splash"`` (the default: block-sparse Splash kernels on one device, Mosaic on a TPU and
    the ``xla`` backend elsewhere), ``"reference"`` (the dense float32 oracle, S x S scores per head, the only
    one that supports ``attention_dropout``), or ``"ring"`` /
    ``"allgather"`` / ``"ulysses"`` / ``"usp"``, which run inside ``shard_map`` on the local shard of
    tokens laid out by its ``layout`` (the mask is evaluated on original positions). The same
    parameters give the same function under each strategy.

    ``mask`` picks the attention mask over the sequence: ``"causal"``, ``"local"`` (causal
    sliding window: a query sees itself and the ``local_window`` previous tokens),
    ``"chunked"`` (causal inside chunks of ``chunk_size``), ``"prefix_lm"`` (bidirectional over
    the first ``prefix_len`` tokens) or ``"full"``; or any mask: a function
    ``fn(q_pos, kv_pos) -> bool`` in jnp (a ``masks.FunctionMask`` at every length the model is
    called with), or a ``masks.Mask`` of shape ``(max_seq_len, max_seq_len)`` (that length
    only). Every layer uses the one mask. Packed documents are separated by segment ids passed
    at call time. In ``config.json`` a custom mask is recorded by its ``repr`` / function name.

    ``qk_clip_threshold`` (None or a positive τ) turns on QK-clip in training: after each
    optimiser update the W_q / W_k columns of every head whose largest attention logit in that
    step's forward pass exceeded τ are rescaled so that logit becomes τ
    (``ringsplash.model.qk_clip``).

    ``max_seq_len`` is the (global) training length, checked against the ring size and the
    Splash block sizes. ``head_dim=None`` means ``d_model // num_heads``; ``v_head_dim`` is
    the value (and attention output) head size, ``None`` = ``head_dim`` (MLA-style models use
    e.g. q/k 192, v 128); the SwiGLU hidden width is ``mlp_ratio * d_model`` rounded up to a
    multiple of ``mlp_multiple``, or ``features.intermediate_size`` when given.

    ``features`` (a ``ModelFeatures``) holds the options of the Hugging Face families (GeGLU,
    biases, q/k norms, norm offsets, soft caps, tied embeddings, RoPE scaling, per-layer sliding
    windows, the tokenizer's special ids); its defaults keep ringsplash's own model.

    The previous release's flat fields (``attention``, ``ring_size``, ..., ``mlp_activation``, ...)
    still work for one release, as keywords, in ``replace`` and as attributes, with a
    ``DeprecationWarning`` naming the nested spelling (``model/_legacy.py``).
    """

    vocab_size: int
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None  # None = num_heads (MHA); 1 = MQA
    head_dim: int | None = None
    v_head_dim: int | None = None  # None = head_dim
    mlp_ratio: float = 8 / 3
    mlp_multiple: int = 8
    rope_theta: float = 10_000.0
    max_seq_len: int = 2048
    context_parallel: ContextParallel = ContextParallel()
    mask: "MaskKind | masks_lib.Mask | Callable" = "causal"
    local_window: int | None = None
    chunk_size: int | None = None
    prefix_len: int | None = None
    logit_soft_cap: float | None = None
    sinks: bool = False
    attention_dropout: float = 0.0
    qk_clip_threshold: float | None = None
    remat: RematPolicy = "none"
    param_dtype: DType = "float32"
    compute_dtype: DType = "float32"
    splash: SplashConfig = SplashConfig()
    features: ModelFeatures = ModelFeatures()

    def __post_init__(self):
        plain_fields(self)  # NumPy / JAX scalars as Python numbers: checked, hashed and written as such
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "max_seq_len", "mlp_multiple"):
            check_positive_int(name, getattr(self, name))
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        check_positive_int("num_kv_heads", self.num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads} "
                f"(GQA groups): pick num_kv_heads among the divisors of num_heads"
            )
        if self.head_dim is None:
            if self.d_model % self.num_heads:
                raise ValueError(
                    f"head_dim=None needs num_heads={self.num_heads} to divide d_model={self.d_model}: "
                    f"set head_dim explicitly or change num_heads"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs): use an even head_dim")
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        check_positive_int("v_head_dim", self.v_head_dim)
        check_float("mlp_ratio", self.mlp_ratio, positive=True)
        check_float("rope_theta", self.rope_theta, positive=True)
        cp = self.context_parallel
        if not isinstance(cp, ContextParallel):
            raise TypeError(f"context_parallel must be a ringsplash.model.ContextParallel, got {type(cp).__name__} "
                            f"{cp!r} (e.g. ContextParallel('ring', ring_size=4))")
        check_choice("remat", self.remat, REMAT_POLICIES)
        check_bool("sinks", self.sinks)
        self._check_mask()
        for name in ("param_dtype", "compute_dtype"):
            check_choice(name, getattr(self, name), DTYPES)
        if self.logit_soft_cap is not None:
            check_float("logit_soft_cap", self.logit_soft_cap, positive=True)
        dropout = check_float("attention_dropout", self.attention_dropout, minimum=0.0)
        if not dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got attention_dropout={self.attention_dropout!r}")
        if self.qk_clip_threshold is not None:
            check_float("qk_clip_threshold", self.qk_clip_threshold, positive=True)
        check_features(self)
        if not isinstance(self.splash, SplashConfig):
            raise TypeError(f"splash must be a ringsplash.SplashConfig, got {type(self.splash).__name__}")

        kernels = cp.strategy != "reference"
        if kernels and self.attention_dropout > 0:
            raise ValueError(
                f"attention_dropout={self.attention_dropout} is not supported by the splash/ring kernels: "
                f"use context_parallel=ContextParallel('reference') or attention_dropout=0"
            )
        cp.check_heads(self.num_heads, self.num_kv_heads)
        # Any head size runs on the TPU kernels (64, 96, 128, 192, 256 and v != q/k compile for v5e in
        # tests/test_head_dims_tpu_compile.py); a block x head size x dtype that overflows the chip's VMEM
        # is rejected when lowered for that chip (ringsplash.splash.vmem), the chip being unknown here.
        if kernels:
            self._check_lengths()

    def __getattr__(self, name: str):  # only for names that are not attributes: the old flat fields
        if name in _legacy.OLD_NAMES:
            return _legacy.read_old(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _check_mask(self) -> None:
        if not isinstance(self.mask, str):
            self._check_custom_mask()
            return
        check_choice("mask", self.mask, MASKS)
        needs = {"local": "local_window", "chunked": "chunk_size", "prefix_lm": "prefix_len"}
        for mask, option in needs.items():
            value = getattr(self, option)
            if self.mask == mask:
                minimum = 0 if option != "chunk_size" else 1
                try:
                    check_int(option, value, minimum=minimum)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"mask={mask!r} needs {option}=<int >= {minimum}>: {e}") from None
            elif value is not None:
                raise ValueError(f"{option}={value!r} only applies to mask={mask!r}: set {option}=None")
        if self.mask == "prefix_lm" and self.prefix_len > self.max_seq_len:
            raise ValueError(f"prefix_len={self.prefix_len} must be <= max_seq_len={self.max_seq_len}")

    def _check_custom_mask(self) -> None:
        """A ``Mask`` of the training length, or a mask function; no named-kind options."""
        m = self.mask
        if isinstance(m, masks_lib.MultiHeadMask):
            raise TypeError(f"mask must be one 2-D mask for every head, got a MultiHeadMask of {len(m)} heads")
        if isinstance(m, masks_lib.Mask):
            if m.shape != (self.max_seq_len, self.max_seq_len):
                raise ValueError(
                    f"mask={m!r} has shape {m.shape}, not (max_seq_len, max_seq_len) = "
                    f"{(self.max_seq_len, self.max_seq_len)}: build it at that length, or pass a function "
                    f"fn(q_pos, kv_pos) -> bool, which serves every length")
        elif callable(m):
            masks_lib.FunctionMask((self.max_seq_len, self.max_seq_len), m)  # probes fn: a clear error now
        else:
            raise TypeError(f"mask must be one of {MASKS}, a ringsplash.masks.Mask or a function "
                            f"fn(q_pos, kv_pos) -> bool, got {type(m).__name__} {m!r}")
        for option in ("local_window", "chunk_size", "prefix_len"):
            if getattr(self, option) is not None:
                raise ValueError(f"{option}={getattr(self, option)!r} only applies to a named mask kind, "
                                 f"not mask={m!r}: set {option}=None (or build the window into the mask)")

    def _check_lengths(self) -> None:
        if self.context_parallel.roles and not isinstance(self.mask, masks_lib.Mask):
            self.padded_seq_len(self.max_seq_len)  # a length the strategy does not tile is padded (train.layout_batch)
        else:  # a fixed-shape Mask serves its own length only: never padded
            self.check_seq_len(self.max_seq_len, name="max_seq_len")

    def check_seq_len(self, seq_len: int, *, name: str = "seq_len") -> None:
        """Raise unless the strategy runs at a global length of ``seq_len`` tokens as it is
        (``ContextParallel.check_seq_len`` with this config's Splash blocks); ``name``: the
        length's name in errors."""
        self.context_parallel.check_seq_len(seq_len, self.splash, name=name)

    def padded_seq_len(self, seq_len: int) -> int:
        """The global length a sequence of ``seq_len`` tokens runs at under the context-parallel
        strategy: the smallest length >= ``seq_len`` that the ``context_parallel.layout`` splits over the
        devices and the Splash blocks tile (``check_seq_len``). The trainer pads every batch to it
        (``ringsplash.train.layout_batch``); ``seq_len`` itself when it tiles, and without context
        parallelism. A fixed-shape ``Mask`` serves its own length only, so it is never padded."""
        check_positive_int("seq_len", seq_len)
        if not self.context_parallel.roles:
            return seq_len
        return _padded_seq_len(self, seq_len)

    # ------------------------------------------------------------------ derived values

    @property
    def mlp_hidden(self) -> int:
        if self.features.intermediate_size is not None:
            return self.features.intermediate_size
        hidden = math.ceil(self.mlp_ratio * self.d_model)
        return self.mlp_multiple * math.ceil(hidden / self.mlp_multiple)

    @property
    def strategy(self) -> str:
        """The attention strategy (``context_parallel.strategy``)."""
        return self.context_parallel.strategy

    @property
    def context_shards(self) -> int:
        """Devices the sequence is sharded over (``ring_size * ulysses_size``; 1 without context parallelism)."""
        return self.context_parallel.shards

    @property
    def layout_shards(self) -> int:
        """Shards of the ``context_parallel.layout`` permutation (``ContextParallel.layout_shards``)."""
        return self.context_parallel.layout_shards

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention_kinds(self) -> tuple[str | None, ...]:
        """The distinct masks of the layers: ``(None,)`` (every layer uses ``mask``) or the layer types used."""
        layer_types = self.features.layer_types
        return (None,) if layer_types is None else tuple(sorted(set(layer_types)))

    def _check_layer_type(self, layer_type: str | None) -> None:
        """``layer_type`` None or one of ``LAYER_TYPES``, sliding only with a window: an unknown name gave the
        model's own mask / RoPE silently, "sliding_attention" without ``sliding_window`` a TypeError in the mask."""
        check_choice("layer_type", layer_type, (None, *LAYER_TYPES))
        if layer_type == SLIDING and self.features.sliding_window is None:
            raise ValueError(f"layer_type={SLIDING!r} needs features.sliding_window (this config has none)")

    def rope_for(self, layer_type: str | None = None) -> tuple[float, RopeScaling | None]:
        """``(theta, scaling)`` of the RoPE of a layer of ``layer_type`` (``local_rope_theta``: sliding
        layers' own base, unscaled, with Hugging Face's numerics when the model's RoPE has them)."""
        self._check_layer_type(layer_type)
        f = self.features
        if layer_type == SLIDING and f.local_rope_theta is not None:
            return f.local_rope_theta, None if f.rope_scaling is None else RopeScaling()
        return self.rope_theta, f.rope_scaling

    def make_mask(self, seq_len: int, layer_type: str | None = None) -> masks_lib.Mask:
        """The ``(seq_len, seq_len)`` attention mask over original positions (lazy, hashable) of a layer
        of ``layer_type`` (None or ``"full_attention"``: ``mask``)."""
        self._check_layer_type(layer_type)
        shape = (seq_len, seq_len)
        if layer_type == SLIDING:
            return masks_lib.LocalMask(shape, window=(self.features.sliding_window - 1, 0))
        if isinstance(self.mask, masks_lib.Mask):
            if self.mask.shape != shape:
                raise ValueError(f"mask={self.mask!r} has shape {self.mask.shape}, but the model is called on "
                                 f"{seq_len} tokens: a Mask serves its own length only; pass a function "
                                 f"fn(q_pos, kv_pos) -> bool as mask to serve every length")
            return self.mask
        if callable(self.mask):
            return masks_lib.FunctionMask(shape, self.mask)  # equal for equal (shape, fn): caches hit
        if self.mask == "causal":
            return masks_lib.CausalMask(shape)
        if self.mask == "local":
            return masks_lib.LocalMask(shape, window=(self.local_window, 0))
        if self.mask == "chunked":
            return masks_lib.ChunkedCausalMask(shape, chunk_size=self.chunk_size)
        if self.mask == "prefix_lm":
            return masks_lib.PrefixLMMask(shape, prefix_len=min(self.prefix_len, seq_len))
        return masks_lib.FullMask(shape)

    def replace(self, **changes) -> "TransformerConfig":
        """A copy with ``changes`` applied (and validated)."""
        current = {"context_parallel": self.context_parallel, "features": self.features}
        return dataclasses.replace(self, **_legacy.nest({**current, **changes}, stacklevel=4))

    def to_dict(self) -> dict:
        plain = self if isinstance(self.mask, str) else dataclasses.replace(self, mask="causal")  # asdict copies
        d = dataclasses.asdict(plain)
        d["mask"] = _mask_record(self.mask)
        d["splash"] = {k: v for k, v in dataclasses.asdict(self.splash).items() if k != "interpret_params"}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TransformerConfig":
        """The config of ``to_dict``'s dict (also the flat form of the previous release, which
        checkpoints and run directories written before hold)."""
        if not isinstance(d, Mapping):  # None was "'NoneType' object is not iterable"
            raise TypeError(f"d must be a dict (TransformerConfig.to_dict()'s), got {type(d).__name__}: {d!r}")
        d = dict(d)
        if isinstance(d.get("mask"), str) and d["mask"] not in MASKS:
            raise ValueError(f"the config records a custom mask ({d['mask']}), which a dict cannot rebuild: "
                             f"pass the mask itself, from_dict({{**d, 'mask': my_mask_or_function}})")
        if isinstance(d.get("splash"), dict):
            d["splash"] = SplashConfig(**d["splash"])
        if isinstance(d.get("context_parallel"), dict):
            d["context_parallel"] = ContextParallel(**d["context_parallel"])
        if isinstance(d.get("features"), dict):
            d["features"] = ModelFeatures(**_features_from_json(d["features"]))
        return cls(**_legacy.nest(_features_from_json(d), warn=False))


def _features_from_json(d: dict) -> dict:
    """``d`` with the ``ModelFeatures`` values JSON changes back in their types (the dict of
    ``features``, or a flat config dict of the previous release)."""
    d = dict(d)
    if isinstance(d.get("rope_scaling"), dict):
        d["rope_scaling"] = RopeScaling.from_dict(d["rope_scaling"])
    for name in ("layer_types", "eos_token_id"):
        if isinstance(d.get(name), list):  # JSON has no tuples
            d[name] = tuple(d[name])
    return d


_dataclass_init = TransformerConfig.__init__


def _init(self, *args, **kwargs):  # the old flat names still work for one release (model/_legacy.py)
    _dataclass_init(self, *args, **_legacy.nest(kwargs))


_init.__doc__, _init.__signature__ = _dataclass_init.__doc__, inspect.signature(_dataclass_init)
TransformerConfig.__init__ = _init


@caches.lru_cache(maxsize=256)
def _padded_seq_len(config: TransformerConfig, seq_len: int) -> int:
    """``TransformerConfig.padded_seq_len`` (cached: the trainer asks once per batch). Candidates are
    the multiples of the layout's chunk count (and of the devices); a multiple of 128 chunks tiles
    any configured block (a multiple of 128), so the search ends within 128 candidates."""
    if isinstance(config.mask, masks_lib.Mask):
        config.check_seq_len(seq_len)
        return seq_len
    step = config.context_parallel.pad_step()
    last = -(-seq_len // (step * NUM_LANES)) * step * NUM_LANES
    for length in range(-(-seq_len // step) * step, last, step):
        try:
            config.check_seq_len(length)
        except ValueError:
            continue
        return length
    config.check_seq_len(last)  # tiles (see above); raises, naming the field, should a config ever not
    return last


def dtype_of(name: str):
    """numpy/jnp dtype for a config dtype name."""
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def _mask_record(mask) -> str:
    """``mask`` for config.json: a named kind as is, a Mask by repr, a function by its qualified name."""
    if isinstance(mask, str):
        return mask
    if isinstance(mask, masks_lib.Mask):
        return repr(mask)
    return f"function {getattr(mask, '__module__', '?')}.{getattr(mask, '__qualname__', repr(mask))}"


__all__ = ["DTYPES", "MASKS", "REMAT_POLICIES", "RING_AXIS_STRATEGIES", "STRATEGIES", "ULYSSES_AXIS_STRATEGIES",
           "RematPolicy", "TransformerConfig", "dtype_of"]
