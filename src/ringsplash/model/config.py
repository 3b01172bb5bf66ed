"""``TransformerConfig``: every hyperparameter of the model, validated once at construction.

A config that constructs is a config that runs: each rejected combination raises a
``ValueError`` naming the option and the fix, never an error deep inside a traced call.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

from ringsplash import _caches as caches
from ringsplash import layouts
from ringsplash import masks as masks_lib
from ringsplash._scalar_checks import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_name,
    check_positive_int,
    literal_choices,
)
from ringsplash.model.hf_features import SLIDING, LayerType, MlpActivation, check_hf_features
from ringsplash.model.parallelism import RING_AXIS_STRATEGIES, ULYSSES_AXIS_STRATEGIES, ContextParallel, Strategy
from ringsplash.model.rope_scaling import RopeScaling, check_rope_dim
from ringsplash.parallel.heads import usp_factorisations, valid_ulysses_degrees
from ringsplash.parallel.ring_plan import fit_ring_blocks
from ringsplash.splash.blocks import Extent, fit_blocks
from ringsplash.splash.config import NUM_LANES, SplashConfig

MaskKind = Literal["causal", "local", "chunked", "prefix_lm", "full"]
DType = Literal["float32", "bfloat16", "float16"]
STRATEGIES: tuple[str, ...] = literal_choices(Strategy)
MASKS: tuple[str, ...] = literal_choices(MaskKind)
DTYPES: tuple[str, ...] = literal_choices(DType)
#: ``remat`` policies for the scanned layer step (see ``ringsplash.model.transformer.remat_policy``):
#: ``"none"`` saves every residual, ``"full"`` saves only the layer input and recomputes the layer,
#: ``"save_attention"`` saves the attention outputs (and their log-sum-exp) so the backward pass
#: recomputes the projections and the MLP but never the attention, ``"save_dots"`` saves every
#: matmul result without batch dimensions plus the attention outputs.
RematPolicy = Literal["none", "full", "save_attention", "save_dots"]
REMAT_POLICIES: tuple[str, ...] = literal_choices(RematPolicy)
#: strategies whose attention returns per-head max logits (``return_max_logits``), so QK-clip can run
MAX_LOGIT_STRATEGIES: tuple[str, ...] = STRATEGIES


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Decoder-only transformer: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

    Attention strategies (the same parameters give the same function under each):

    * ``"reference"`` — dense float32 oracle (``ringsplash.reference_attention``); the only one
      that supports ``attention_dropout``;
    * ``"splash"`` — block-sparse Splash attention on one device (``splash_attention``);
    * ``"ring"`` — ring attention over the mesh axis ``ring_axis_name`` of ``ring_size``
      devices; the model must then be called inside ``shard_map`` on the local shard of tokens
      laid out by ``ring_layout`` (the mask is evaluated on original positions);
    * ``"allgather"`` — the Llama-3 method over ``ring_axis_name`` (``ring_size`` devices): K/V
      all-gathered, local queries; same local shards and layout as the ring;
    * ``"ulysses"`` — DeepSpeed-Ulysses over ``ulysses_axis_name`` (``ulysses_size`` devices,
      which must split the heads: ``num_heads`` divisible by it, ``num_kv_heads`` dividing or
      divisible by it); local shards laid out by ``ring_layout`` over ``ulysses_size``;
    * ``"usp"`` — Ulysses over ``ulysses_axis_name`` (``ulysses_size``, inside) and the ring over
      ``ring_axis_name`` (``ring_size``, across): local shard ``r * ulysses_size + u`` of the
      sequence laid out by ``ring_layout`` over ``ring_size`` (not over the product).

    Every sequence-parallel strategy is called inside ``shard_map`` on local shards
    (``context_shards`` of them, ``layout_shards`` for the layout permutation); the axes, sizes
    and layout are summarised by ``context_parallel`` (a ``ContextParallel``).

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

    ``rope_scaling`` (None or a ``RopeScaling``: linear, dynamic NTK, YaRN, Llama 3, LongRoPE) scales
    RoPE with Hugging Face's numerics (``ringsplash.model.rope_scaling``); None keeps ringsplash's own RoPE.

    ``max_seq_len`` is the (global) training length, checked against the ring size and the
    Splash block sizes. ``head_dim=None`` means ``d_model // num_heads``; ``v_head_dim`` is
    the value (and attention output) head size, ``None`` = ``head_dim`` (MLA-style models use
    e.g. q/k 192, v 128); the SwiGLU hidden width is ``mlp_ratio * d_model`` rounded up to a
    multiple of ``mlp_multiple``, or ``intermediate_size`` when given.

    Hugging Face families (``ringsplash.model.hf_features``; defaults keep ringsplash's own model):
    ``mlp_activation`` (``"silu"``, or ``"gelu_tanh"`` for Gemma's GeGLU); ``attention_bias`` (q/k/v
    projection biases, Qwen2); ``qk_norm`` (RMSNorm over head_dim on q and k per head before RoPE,
    Qwen3 / Gemma 3); ``norm_eps`` of every RMSNorm; ``norm_offset`` (RMSNorm scales by
    ``norm_offset + weight`` in float32: Gemma's 1.0; fresh weights are ``1 - norm_offset``);
    ``post_norms`` (Gemma's RMSNorm on the attention and MLP outputs before the residual adds);
    ``scale_embeddings`` (embeddings times sqrt(d_model), the factor rounded to the compute dtype first);
    ``attention_scale`` (softmax scale, None = head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5);
    ``final_logit_soft_cap`` (logits = cap * tanh(logits / cap), in float32; ``logit_soft_cap`` caps the
    attention logits); ``layer_types`` (None, or per layer ``"full_attention"`` (uses ``mask``) /
    ``"sliding_attention"``: a causal window of ``sliding_window`` tokens, the query included, as in
    Hugging Face: ``LocalMask(window=(sliding_window - 1, 0))``); ``local_rope_theta`` (the RoPE base of
    sliding layers, unscaled: Gemma 3; None = theirs is the full layers' RoPE). ``tie_embeddings``: the
    unembedding is ``embedding.T`` itself (a fresh tied model draws the embedding with std
    d_model ** -0.5, so its logits start well scaled).

    ``bos_token_id`` / ``eos_token_id`` (an int or several) / ``pad_token_id``: the tokenizer's special
    ids as a Hugging Face config.json records them (``ringsplash.hf`` reads and writes them); the model
    itself never reads them.
    """

    vocab_size: int
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None  # None = num_heads (MHA); 1 = MQA
    head_dim: int | None = None
    mlp_ratio: float = 8 / 3
    mlp_multiple: int = 8
    rope_theta: float = 10_000.0
    max_seq_len: int = 2048
    attention: Strategy = "reference"
    mask: "MaskKind | masks_lib.Mask | Callable" = "causal"
    local_window: int | None = None
    chunk_size: int | None = None
    prefix_len: int | None = None
    ring_axis_name: str | None = None
    ring_layout: layouts.Layout = "zigzag"
    ring_size: int = 1
    ulysses_axis_name: str | None = None
    ulysses_size: int = 1
    logit_soft_cap: float | None = None
    sinks: bool = False
    attention_dropout: float = 0.0
    remat: RematPolicy = "none"
    tie_embeddings: bool = False
    param_dtype: DType = "float32"
    compute_dtype: DType = "float32"
    splash: SplashConfig = SplashConfig()
    v_head_dim: int | None = None  # None = head_dim
    qk_clip_threshold: float | None = None
    rope_scaling: RopeScaling | None = None
    intermediate_size: int | None = None  # None = the mlp_ratio / mlp_multiple rule
    mlp_activation: MlpActivation = "silu"
    attention_bias: bool = False
    qk_norm: bool = False
    norm_eps: float = 1e-6
    norm_offset: float = 0.0
    post_norms: bool = False
    scale_embeddings: bool = False
    attention_scale: float | None = None  # None = head_dim ** -0.5
    final_logit_soft_cap: float | None = None
    layer_types: tuple[LayerType, ...] | None = None  # None = every layer uses mask
    sliding_window: int | None = None
    local_rope_theta: float | None = None  # None = sliding layers use the full layers' RoPE
    # the tokenizer's special ids, as Hugging Face's config.json records them (the model ignores them)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "max_seq_len", "ring_size", "mlp_multiple",
                     "ulysses_size"):
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
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, RopeScaling):
                raise TypeError(f"rope_scaling must be a ringsplash.model.RopeScaling or None, got "
                                f"{type(self.rope_scaling).__name__} (a Hugging Face dict: RopeScaling.from_hf(d))")
            check_rope_dim(self.rope_scaling, self.head_dim)

        check_choice("attention", self.attention, STRATEGIES)
        check_choice("remat", self.remat, REMAT_POLICIES)
        check_choice("ring_layout", self.ring_layout, layouts.LAYOUTS)
        for name in ("ring_axis_name", "ulysses_axis_name"):
            if getattr(self, name) not in (None, ""):  # none: no such axis (checked against the strategy below)
                check_name(name, getattr(self, name))
        for name in ("sinks", "tie_embeddings", "attention_bias", "qk_norm", "post_norms", "scale_embeddings"):
            check_bool(name, getattr(self, name))
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
            if self.attention not in MAX_LOGIT_STRATEGIES:
                raise ValueError(
                    f"qk_clip_threshold needs the attention strategy to report max logits; attention="
                    f"{self.attention!r} cannot: use one of {MAX_LOGIT_STRATEGIES} or qk_clip_threshold=None"
                )
        check_hf_features(self)
        self._check_token_ids()
        if not isinstance(self.splash, SplashConfig):
            raise TypeError(f"splash must be a ringsplash.SplashConfig, got {type(self.splash).__name__}")

        kernels = self.attention != "reference"
        if kernels and self.attention_dropout > 0:
            raise ValueError(
                f"attention_dropout={self.attention_dropout} is not supported by the splash/ring kernels: "
                f"use attention='reference' or attention_dropout=0"
            )
        self._check_parallel()
        # Any head size runs on the TPU kernels (64, 96, 128, 192, 256 and v != q/k compile for v5e in
        # tests/test_head_dims_tpu_compile.py); a block x head size x dtype that overflows the chip's VMEM
        # is rejected when lowered for that chip (ringsplash.splash.vmem), the chip being unknown here.
        if kernels:
            self._check_lengths()

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

    def _check_parallel(self) -> None:
        """The mesh axes and sizes each strategy needs (``ring_*``: ring / all-gather / USP's ring,
        ``ulysses_*``: Ulysses / USP's all-to-all); unused ones must stay at their defaults."""
        a = self.attention
        if a in RING_AXIS_STRATEGIES:
            if not self.ring_axis_name:
                what = "the ring axis across" if a == "usp" else "the mesh axis the sequence is sharded over"
                raise ValueError(
                    f"attention={a!r} needs ring_axis_name ({what}, e.g. ring_axis_name='context')"
                )
        elif self.ring_size != 1:
            raise ValueError(
                f"ring_size={self.ring_size} needs attention='ring' (or 'allgather' / 'usp', which also shard the "
                f"sequence over ring_axis_name; attention={a!r} does not): set one of them or ring_size=1"
            )
        if a in ULYSSES_AXIS_STRATEGIES:
            if not self.ulysses_axis_name:
                raise ValueError(
                    f"attention={a!r} needs ulysses_axis_name (the mesh axis of the all-to-all, e.g. "
                    f"ulysses_axis_name={'ulysses' if a == 'usp' else 'context'!r})"
                )
            h, kv, u = self.num_heads, self.num_kv_heads, self.ulysses_size
            ok = valid_ulysses_degrees(h, kv)
            if u not in ok:
                why = (f"num_heads={h} is not divisible by ulysses_size={u}" if h % u else
                       f"num_kv_heads={kv} neither divides nor is divisible by ulysses_size={u}")
                alt = ""
                if a == "usp":
                    n = u * self.ring_size
                    alt = (f"; (ulysses_size, ring_size) factorisations of the {n} devices that work: "
                           f"{usp_factorisations(n, h, kv)}")
                raise ValueError(f"attention={a!r}: {why} (Ulysses gives each device num_heads / ulysses_size q "
                                 f"heads): use ulysses_size in {ok}{alt}")
        elif self.ulysses_size != 1:
            raise ValueError(
                f"ulysses_size={self.ulysses_size} needs attention='ulysses' or 'usp' (attention={a!r}): "
                f"set one of them or ulysses_size=1"
            )
        if a == "usp" and self.ring_axis_name == self.ulysses_axis_name:
            raise ValueError(
                f"attention='usp' needs two different mesh axes: ring_axis_name and ulysses_axis_name are both "
                f"{self.ring_axis_name!r} (e.g. ring_axis_name='context', ulysses_axis_name='ulysses')"
            )
        if a in RING_AXIS_STRATEGIES + ULYSSES_AXIS_STRATEGIES:
            check_choice("ring_layout", self.ring_layout, layouts.LAYOUTS)

    def _check_lengths(self) -> None:
        if self.context_parallel.roles and not isinstance(self.mask, masks_lib.Mask):
            self.padded_seq_len(self.max_seq_len)  # a length the strategy does not tile is padded (train.layout_batch)
        else:  # a fixed-shape Mask serves its own length only: never padded
            self.check_seq_len(self.max_seq_len, name="max_seq_len")

    def check_seq_len(self, seq_len: int, *, name: str = "seq_len") -> None:
        """Raise unless the strategy runs at a global length of ``seq_len`` tokens as it is: the
        ``ring_layout`` splits it over the devices and the Splash blocks tile what each kernel sees
        (``splash/blocks.py``; the ring and USP shrink blocks to their shards). ``"splash"`` pads
        a length its 128-token lanes do not tile itself (``model.attention``); ``name``: the
        length's name in errors."""
        if self.attention in ("ring", "usp"):  # the ring shrinks blocks to its shards, or says which config fits
            if seq_len % self.context_shards:
                raise ValueError(
                    f"{name}={seq_len} must be divisible by ring_size x ulysses_size = "
                    f"{self.ring_size} x {self.ulysses_size} = {self.context_shards} (one shard per device)"
                )
            fit_ring_blocks(seq_len, self.ring_size, self.ring_layout, self.splash)
            return
        a, seq = self.attention, seq_len
        if a in ("allgather", "ulysses"):
            layouts.check_layout(self.ring_layout, seq, self.layout_shards)
        if a not in ("splash", "allgather", "ulysses"):
            return
        # the rule of every Splash path (splash/blocks.py), on the lengths this strategy's kernels see
        if a == "splash":  # the model pads a length the kernels' 128-token lanes do not tile (model.attention)
            seq = -(-seq // NUM_LANES) * NUM_LANES
        q_len = seq // self.ring_size if a == "allgather" else seq
        multiple = {"splash": NUM_LANES, "allgather": self.ring_size * NUM_LANES,
                    "ulysses": math.lcm(self.ulysses_size, NUM_LANES)}[a]
        fit_blocks(self.splash, q=Extent(q_len, q_len, name if q_len == seq else "per-device q_len"),
                   kv=Extent(seq, seq, name), what=f"attention={a!r} at {name}={seq}",
                   length_hint=f"a {name} divisible by {multiple}")

    def padded_seq_len(self, seq_len: int) -> int:
        """The global length a sequence of ``seq_len`` tokens runs at under the context-parallel
        strategy: the smallest length >= ``seq_len`` that the ``ring_layout`` splits over the
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
        if self.intermediate_size is not None:
            return self.intermediate_size
        hidden = math.ceil(self.mlp_ratio * self.d_model)
        return self.mlp_multiple * math.ceil(hidden / self.mlp_multiple)

    @property
    def context_parallel(self) -> ContextParallel:
        """The strategy's mesh axes, their sizes and the sequence layout."""
        return ContextParallel.from_config(self)

    @property
    def context_shards(self) -> int:
        """Devices the sequence is sharded over (``ring_size * ulysses_size``; 1 without context parallelism)."""
        return self.context_parallel.shards

    @property
    def layout_shards(self) -> int:
        """Shards of the ``ring_layout`` permutation (``ContextParallel.layout_shards``)."""
        return self.context_parallel.layout_shards

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention_kinds(self) -> tuple[str | None, ...]:
        """The distinct masks of the layers: ``(None,)`` (every layer uses ``mask``) or the layer types used."""
        return (None,) if self.layer_types is None else tuple(sorted(set(self.layer_types)))

    def rope_for(self, layer_type: str | None = None) -> tuple[float, RopeScaling | None]:
        """``(theta, scaling)`` of the RoPE of a layer of ``layer_type`` (``local_rope_theta``: sliding
        layers' own base, unscaled, with Hugging Face's numerics when the model's RoPE has them)."""
        if layer_type == SLIDING and self.local_rope_theta is not None:
            return self.local_rope_theta, None if self.rope_scaling is None else RopeScaling()
        return self.rope_theta, self.rope_scaling

    def make_mask(self, seq_len: int, layer_type: str | None = None) -> masks_lib.Mask:
        """The ``(seq_len, seq_len)`` attention mask over original positions (lazy, hashable) of a layer
        of ``layer_type`` (None or ``"full_attention"``: ``mask``)."""
        shape = (seq_len, seq_len)
        if layer_type == SLIDING:
            return masks_lib.LocalMask(shape, window=(self.sliding_window - 1, 0))
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
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        plain = self if isinstance(self.mask, str) else dataclasses.replace(self, mask="causal")  # asdict copies
        d = dataclasses.asdict(plain)
        d["mask"] = _mask_record(self.mask)
        d["splash"] = {k: v for k, v in dataclasses.asdict(self.splash).items() if k != "interpret_params"}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TransformerConfig":
        d = dict(d)
        if isinstance(d.get("mask"), str) and d["mask"] not in MASKS:
            raise ValueError(f"the config records a custom mask ({d['mask']}), which a dict cannot rebuild: "
                             f"pass the mask itself, from_dict({{**d, 'mask': my_mask_or_function}})")
        if isinstance(d.get("splash"), dict):
            d["splash"] = SplashConfig(**d["splash"])
        if isinstance(d.get("rope_scaling"), dict):
            d["rope_scaling"] = RopeScaling.from_dict(d["rope_scaling"])
        for name in ("layer_types", "eos_token_id"):
            if isinstance(d.get(name), list):  # JSON has no tuples
                d[name] = tuple(d[name])
        return cls(**d)


@caches.lru_cache(maxsize=256)
def _padded_seq_len(config: TransformerConfig, seq_len: int) -> int:
    """``TransformerConfig.padded_seq_len`` (cached: the trainer asks once per batch). Candidates are
    the multiples of the layout's chunk count (and of the devices); a multiple of 128 chunks tiles
    any configured block (a multiple of 128), so the search ends within 128 candidates."""
    if isinstance(config.mask, masks_lib.Mask):
        config.check_seq_len(seq_len)
        return seq_len
    cp = config.context_parallel
    step = math.lcm(cp.shards, cp.layout_shards * (2 if cp.layout == "zigzag" else 1))
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
