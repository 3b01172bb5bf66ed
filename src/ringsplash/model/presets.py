"""Named model sizes: ``preset("llama3-8b", max_seq_len=262144, context_parallel=ContextParallel("ring", ...))``.

A preset fixes the shape of the model (vocabulary, width, depth, heads, MLP width, RoPE base);
everything else (attention strategy, mask, sequence length, dtypes, remat) comes from the
caller. Command lines take ``--preset NAME`` and still let any field be overridden by its own
flag (``ringsplash.cli.parse_config(..., presets=PRESETS)``).

* ``"tiny"``: the main job's model (``experiments/train_long_context.py``: associative recall
  with a 97-token vocabulary, 2 layers, d_model 64, one head, MLP ratio 2).
* ``"1b"``: 16 layers, d_model 2048, 16 heads, 8 kv heads, head_dim 128, SwiGLU 8192, vocab 128256.
* ``"llama3-8b"``: 32 layers, d_model 4096, 32 heads, 8 kv heads, head_dim 128, SwiGLU 14336,
  vocab 128256, RoPE θ 500000 (Llama 3 8B's shape).
"""

import dataclasses

from ringsplash._internal.scalar_checks import check_choice
from ringsplash.model.config import TransformerConfig


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The shape fields of a ``TransformerConfig`` that a preset fixes."""

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_ratio: float  # SwiGLU hidden = mlp_ratio * d_model rounded up to mlp_multiple
    mlp_multiple: int = 8
    rope_theta: float = 10_000.0

    def fields(self) -> dict:
        return dataclasses.asdict(self)


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(vocab_size=97, d_model=64, num_layers=2, num_heads=1, num_kv_heads=1, head_dim=64,
                       mlp_ratio=2.0),
    "1b": ModelShape(vocab_size=128256, d_model=2048, num_layers=16, num_heads=16, num_kv_heads=8, head_dim=128,
                     mlp_ratio=4.0, mlp_multiple=256, rope_theta=500_000.0),
    "llama3-8b": ModelShape(vocab_size=128256, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                            head_dim=128, mlp_ratio=3.5, mlp_multiple=256, rope_theta=500_000.0),
}
PRESET_NAMES = tuple(PRESETS)


def preset_shape(name: str) -> ModelShape:
    """The ``ModelShape`` called ``name`` (a ``ValueError`` lists the choices otherwise)."""
    return PRESETS[check_choice("preset", name, PRESET_NAMES)]


def preset(name: str, **overrides) -> TransformerConfig:
    """A ``TransformerConfig`` of the preset ``name`` with ``overrides`` (any field) applied.

    Args:
        name: one of ``PRESET_NAMES``.
        **overrides: ``TransformerConfig`` fields, shape fields included.
    """
    return TransformerConfig(**{**preset_shape(name).fields(), **overrides})


__all__ = ["PRESETS", "PRESET_NAMES", "ModelShape", "preset", "preset_shape"]
