"""Which Hugging Face tensor each ``Transformer`` parameter is, per family.

Parameters are named by their path in the model (``"layers.attention.wq"``). ``Transformer.layers``
stacks every layer on a leading axis; its HF tensors are one per layer (``{i}`` in the name).
Our matmul weights are ``[in, out]``; ``torch.nn.Linear`` stores ``[out, in]``: those are
transposed (``transpose=True``). HF's rotate-half RoPE acts on q/k in the order the checkpoint
stores them, as ours does, so no head permutation is needed.
"""

import dataclasses

import jax

from ringsplash.model import TransformerConfig, abstract_model


@dataclasses.dataclass(frozen=True)
class TensorName:
    """One parameter: its path in the model, its HF tensor name (``{i}``: the layer), whether the
    HF tensor is its transpose, whether it is stacked over layers."""

    path: str
    hf: str
    transpose: bool = False

    @property
    def stacked(self) -> bool:
        return self.path.startswith("layers.")

    def hf_name(self, layer: int | None = None) -> str:
        return self.hf.format(i=layer) if self.stacked else self.hf


_LAYER = "model.layers.{i}."
#: path -> (HF name, transposed); ``post_attention_layernorm`` depends on the family (``name_map``)
_NAMES = {
    "embedding": ("model.embed_tokens.weight", False),
    "unembedding": ("lm_head.weight", True),
    "final_norm.weight": ("model.norm.weight", False),
    "layers.attention_norm.weight": (_LAYER + "input_layernorm.weight", False),
    "layers.attention.wq": (_LAYER + "self_attn.q_proj.weight", True),
    "layers.attention.wk": (_LAYER + "self_attn.k_proj.weight", True),
    "layers.attention.wv": (_LAYER + "self_attn.v_proj.weight", True),
    "layers.attention.wo": (_LAYER + "self_attn.o_proj.weight", True),
    "layers.attention.bq": (_LAYER + "self_attn.q_proj.bias", False),
    "layers.attention.bk": (_LAYER + "self_attn.k_proj.bias", False),
    "layers.attention.bv": (_LAYER + "self_attn.v_proj.bias", False),
    "layers.attention.q_norm.weight": (_LAYER + "self_attn.q_norm.weight", False),
    "layers.attention.k_norm.weight": (_LAYER + "self_attn.k_norm.weight", False),
    "layers.mlp.w_gate": (_LAYER + "mlp.gate_proj.weight", True),
    "layers.mlp.w_up": (_LAYER + "mlp.up_proj.weight", True),
    "layers.mlp.w_down": (_LAYER + "mlp.down_proj.weight", True),
}
_LLAMA_NORMS = {"layers.mlp_norm.weight": _LAYER + "post_attention_layernorm.weight"}
_GEMMA_NORMS = {
    "layers.post_attention_norm.weight": _LAYER + "post_attention_layernorm.weight",
    "layers.mlp_norm.weight": _LAYER + "pre_feedforward_layernorm.weight",
    "layers.post_mlp_norm.weight": _LAYER + "post_feedforward_layernorm.weight",
}


def path_name(path) -> str:
    """``"layers.attention.wq"`` for a ``jax.tree_util`` key path."""
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def abstract_params(config: TransformerConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """``{path: ShapeDtypeStruct}`` of every parameter of ``Transformer(config)``, in tree order."""
    model = abstract_model(config)
    leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    return {path_name(p): x for p, x in leaves if isinstance(x, jax.ShapeDtypeStruct)}


def name_map(config: TransformerConfig, *, gemma_norms: bool) -> dict[str, TensorName]:
    """``{path: TensorName}`` for every parameter of ``Transformer(config)``; a ``ValueError``
    names a parameter no HF tensor corresponds to (e.g. attention sinks)."""
    table = {k: v for k, v in _NAMES.items()}
    table.update({k: (v, False) for k, v in (_GEMMA_NORMS if gemma_norms else _LLAMA_NORMS).items()})
    out = {}
    for path in abstract_params(config):
        if path not in table:
            raise ValueError(f"parameter {path!r} of this TransformerConfig has no Hugging Face tensor in these "
                             f"families (e.g. sinks=True has none): such a model cannot be converted")
        out[path] = TensorName(path, *table[path])
    return out


__all__ = ["TensorName", "abstract_params", "name_map", "path_name"]
