"""Which Hugging Face tensor each ``Transformer`` parameter is (the norms' names differ per family:
``Family.norms``, ``families.py``).

Parameters are named by their path in the model (``"layers.attention.wq"``). ``Transformer.layers``
stacks every layer on a leading axis; its HF tensors are one per layer (``{i}`` in the name).
Our matmul weights are ``[in, out]``; ``torch.nn.Linear`` stores ``[out, in]``: those are
transposed (``transpose=True``). HF's rotate-half RoPE acts on q/k in the order the checkpoint
stores them, as ours does, so no head permutation is needed.
"""

import dataclasses
from collections.abc import Mapping

import jax

from ringsplash.model import TransformerConfig, abstract_model
from ringsplash.partitioning import path_name


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


LAYER = "model.layers.{i}."
#: path -> (HF name, transposed), in every family; the norms after ``input_layernorm`` depend on the family
_NAMES = {
    "embedding": ("model.embed_tokens.weight", False),
    "unembedding": ("lm_head.weight", True),
    "final_norm.weight": ("model.norm.weight", False),
    "layers.attention_norm.weight": (LAYER + "input_layernorm.weight", False),
    "layers.attention.wq": (LAYER + "self_attn.q_proj.weight", True),
    "layers.attention.wk": (LAYER + "self_attn.k_proj.weight", True),
    "layers.attention.wv": (LAYER + "self_attn.v_proj.weight", True),
    "layers.attention.wo": (LAYER + "self_attn.o_proj.weight", True),
    "layers.attention.bq": (LAYER + "self_attn.q_proj.bias", False),
    "layers.attention.bk": (LAYER + "self_attn.k_proj.bias", False),
    "layers.attention.bv": (LAYER + "self_attn.v_proj.bias", False),
    "layers.attention.q_norm.weight": (LAYER + "self_attn.q_norm.weight", False),
    "layers.attention.k_norm.weight": (LAYER + "self_attn.k_norm.weight", False),
    "layers.mlp.w_gate": (LAYER + "mlp.gate_proj.weight", True),
    "layers.mlp.w_up": (LAYER + "mlp.up_proj.weight", True),
    "layers.mlp.w_down": (LAYER + "mlp.down_proj.weight", True),
}


def named_leaves(tree, kind: type) -> dict[str, object]:
    """``{path: leaf}`` of the leaves of ``tree`` that are ``kind``s, in tree order."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, kind))[0]
    return {path_name(p): x for p, x in leaves if isinstance(x, kind)}


def name_map(config: TransformerConfig, norms: Mapping[str, str]) -> dict[str, TensorName]:
    """``{path: TensorName}`` for every parameter of ``Transformer(config)``, with the family's
    ``norms`` (``{path: HF name}``); a ``ValueError`` names a parameter no HF tensor corresponds to
    (e.g. attention sinks)."""
    table = {**_NAMES, **{path: (hf, False) for path, hf in norms.items()}}
    out = {}
    for path in named_leaves(abstract_model(config), jax.ShapeDtypeStruct):
        if path not in table:
            raise ValueError(f"parameter {path!r} of this TransformerConfig has no Hugging Face tensor in this "
                             f"family (e.g. sinks=True has none): such a model cannot be converted")
        out[path] = TensorName(path, *table[path])
    return out


__all__ = ["LAYER", "TensorName", "name_map", "named_leaves", "path_name"]
