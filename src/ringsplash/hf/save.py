"""``save_hf``: a ``Transformer`` → a directory ``transformers`` loads (config.json,
generation_config.json and safetensors, sharded with an index above ``max_shard_size``).

From a sharded model (``load_hf(mesh=...)``, a trained FSDP state) every process takes part in
gathering one layer's tensor at a time to process 0, which writes; no process ever holds more
than one output file's worth of tensors (at most ``max_shard_size`` bytes).
"""

import json
import os

import jax
import numpy as np

from ringsplash.hf.config import _IMPLICIT, FAMILIES
from ringsplash.hf.io import DEFAULT_MAX_SHARD_SIZE, write_checkpoint
from ringsplash.hf.load import _hf_shape, dtype_name
from ringsplash.hf.names import name_map, path_name
from ringsplash.model import RopeScaling, Transformer, TransformerConfig


def _field(c: TransformerConfig, name: str):
    return getattr(c, name, _IMPLICIT.get(name))


def infer_model_type(c: TransformerConfig) -> str:
    """The family whose architecture ``c`` is (gemma: post-norms; qwen3: q/k norms; qwen2: q/k/v
    biases; mistral: a sliding-window mask; else llama)."""
    if _field(c, "post_norms"):
        return "gemma3_text" if _field(c, "qk_norm") else "gemma2"
    if _field(c, "qk_norm"):
        return "qwen3"
    if _field(c, "attention_bias"):
        return "qwen2"
    return "mistral" if c.mask == "local" else "llama"


def _refuse(what: str, model_type: str) -> None:
    raise ValueError(f"this model cannot be written as model_type={model_type!r}: {what}")


def _rope_dict(c: TransformerConfig, scaling: RopeScaling | None, theta: float) -> dict:
    # rope_scaling=None is ringsplash's own formula; transformers' default differs from it by <= 1 float32 ulp
    return (scaling or RopeScaling()).to_hf(rope_theta=theta)


def _token_ids(c: TransformerConfig) -> dict:
    """bos / eos / pad ids as config.json records them (null when unset, so a family default is not
    substituted when the file is read back); several eos ids as a list."""
    out = {}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = _field(c, name)
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


def generation_config_dict(c: TransformerConfig) -> dict:
    """The ``generation_config.json`` transformers' ``save_pretrained`` writes for a model whose
    generation settings come from its config (``GenerationConfig.from_model_config``): the set token
    ids and the defaults it copies from the model config (less ``transformers_version``)."""
    ids = {k: v for k, v in _token_ids(c).items() if v is not None}
    return dict(_from_model_config=True, **ids, output_attentions=False, output_hidden_states=False, use_cache=True)


def hf_config_dict(c: TransformerConfig, model_type: str | None = None, *, dtype: str | None = None) -> dict:
    """The config.json of ``c`` as ``model_type`` (default: ``infer_model_type``); a ``ValueError``
    names any feature that family cannot express."""
    model_type = model_type or infer_model_type(c)
    if model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not supported: use one of {tuple(FAMILIES)}")
    fam = FAMILIES[model_type]
    if c.sinks:
        _refuse("sinks=True (attention sinks have no Hugging Face tensor here)", model_type)
    if c.v_head_dim != c.head_dim:
        _refuse(f"v_head_dim={c.v_head_dim} != head_dim={c.head_dim}", model_type)
    gemma = fam.gemma_norms
    # the fields each family fixes (those not listed are free: sizes, eps, windows, gemma's scale / caps)
    fixed = dict(mlp_activation="gelu_tanh" if gemma else "silu", norm_offset=1.0 if gemma else 0.0,
                 post_norms=gemma, scale_embeddings=gemma, qk_norm=model_type in ("qwen3", "gemma3_text"),
                 attention_bias=model_type == "qwen2")
    if not gemma:
        fixed.update(attention_scale=None, final_logit_soft_cap=None)
    if model_type != "gemma3_text":
        fixed["local_rope_theta"] = None
    if model_type in ("llama", "mistral"):
        fixed.update(layer_types=None, sliding_window=None)
    for name, value in fixed.items():
        if _field(c, name) != value:
            _refuse(f"{name}={_field(c, name)!r} (the family has {value!r})", model_type)
    mask_ok = c.mask == "causal" or (model_type == "mistral" and c.mask == "local")
    if not isinstance(c.mask, str) or not mask_ok:
        _refuse(f"mask={c.mask!r}", model_type)
    if c.logit_soft_cap is not None and model_type != "gemma2":
        _refuse(f"logit_soft_cap={c.logit_soft_cap}", model_type)
    if not gemma and _field(c, "attention_scale") is not None:
        _refuse(f"attention_scale={_field(c, 'attention_scale')}", model_type)
    scaling = c.rope_scaling
    max_pos = c.max_seq_len
    if scaling is not None and scaling.type == "dynamic":
        max_pos = scaling.original_max_position_embeddings
    d = dict(architectures=[fam.architecture], model_type=model_type, vocab_size=c.vocab_size, hidden_size=c.d_model,
             intermediate_size=c.mlp_hidden, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
             num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, max_position_embeddings=max_pos,
             rms_norm_eps=_field(c, "norm_eps"), tie_word_embeddings=c.tie_embeddings,
             dtype=dtype or c.param_dtype, attention_dropout=0.0, **_token_ids(c))
    d["torch_dtype"] = d["dtype"]  # the key transformers < 4.56 reads (newer versions read dtype)
    if gemma:
        scalar = (_field(c, "attention_scale") or c.head_dim**-0.5) ** -2  # scale = query_pre_attn_scalar ** -0.5
        if abs(scalar - round(scalar)) < 1e-6 * scalar:
            scalar = round(scalar)  # transformers' field is an int
        d.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
                 attn_logit_softcapping=c.logit_soft_cap, final_logit_softcapping=_field(c, "final_logit_soft_cap"))
    else:
        d.update(hidden_act="silu", attention_bias=False, mlp_bias=False)
    if model_type == "mistral":
        d["sliding_window"] = c.local_window + 1 if c.mask == "local" else None
    types = _field(c, "layer_types")
    if model_type in ("qwen2", "qwen3", "gemma2", "gemma3_text"):
        d.update(layer_types=list(types) if types else ["full_attention"] * c.num_layers,
                 sliding_window=_field(c, "sliding_window"))
        if model_type.startswith("qwen"):  # transformers derives layer_types from these when absent
            first = types.index("sliding_attention") if types else c.num_layers
            d.update(use_sliding_window=bool(types), max_window_layers=first)
    if model_type == "gemma3_text":
        d["rope_parameters"] = {"full_attention": _rope_dict(c, scaling, c.rope_theta),
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": float(_field(c, "local_rope_theta"))}}
    else:
        d["rope_parameters"] = _rope_dict(c, scaling, c.rope_theta)
    return d


def save_hf(model: Transformer, path, *, model_type: str | None = None, dtype=None,
            max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """Write ``model`` to the directory ``path`` as a Hugging Face checkpoint: config.json (with the
    config's ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``), generation_config.json (those
    ids, as transformers writes it for a model without its own generation settings) and
    safetensors (``model.safetensors``, or numbered shards of at most ``max_shard_size`` bytes and
    ``model.safetensors.index.json``), which ``transformers.AutoModelForCausalLM.from_pretrained``
    loads. Collective for a model sharded over several processes: every process calls it; process
    0 writes. Returns the safetensors file names.

    Args:
        model_type: the family (default: ``infer_model_type(model.config)``).
        dtype: the stored dtype (name or numpy dtype; default: the parameters' own).
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a ringsplash Transformer, got {type(model).__name__}")
    c = model.config
    model_type = model_type or infer_model_type(c)
    out_dtype = np.dtype(dtype_name("dtype", dtype if dtype is not None else c.param_dtype))
    config = hf_config_dict(c, model_type, dtype=out_dtype.name)
    names = name_map(c, gemma_norms=FAMILIES[model_type].gemma_norms)
    leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    params = {path_name(p): x for p, x in leaves if isinstance(x, jax.Array)}
    where, sizes = {}, {}
    for p, tn in names.items():
        shape = params[p].shape
        for layer in range(shape[0]) if tn.stacked else (None,):
            name = tn.hf_name(layer)
            where[name] = (p, layer)
            sizes[name] = int(np.prod(_hf_shape(tn, shape))) * out_dtype.itemsize

    def produce(group):
        from jax.experimental import multihost_utils

        for name in group:
            p, layer = where[name]
            x = params[p] if layer is None else params[p][layer]
            if not x.is_fully_addressable:  # every process takes part; each gets the whole tensor
                x = multihost_utils.process_allgather(x, tiled=True)
            x = np.asarray(x)
            yield name, (x.T if names[p].transpose else x).astype(out_dtype)

    main = jax.process_index() == 0
    path = os.fspath(path)
    if main:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(generation_config_dict(c), f, indent=2, sort_keys=True)
    return write_checkpoint(path, sizes, produce, max_shard_size=max_shard_size, write=main)


__all__ = ["generation_config_dict", "hf_config_dict", "infer_model_type", "save_hf"]
