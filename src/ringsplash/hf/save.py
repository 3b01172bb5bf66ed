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

from ringsplash._internal.scalar_checks import as_scalar, check_positive_int
from ringsplash.cli import output_dir_problem
from ringsplash.hf.families import family_named, infer_model_type
from ringsplash.hf.family import token_ids
from ringsplash.hf.io import DEFAULT_MAX_SHARD_SIZE, write_checkpoint
from ringsplash.hf.load import dtype_name, hf_shape
from ringsplash.hf.names import named_leaves
from ringsplash.model import Transformer, TransformerConfig


def generation_config_dict(c: TransformerConfig) -> dict:
    """The ``generation_config.json`` transformers' ``save_pretrained`` writes for a model whose
    generation settings come from its config (``GenerationConfig.from_model_config``): the set token
    ids and the defaults it copies from the model config (less ``transformers_version``)."""
    ids = {k: v for k, v in token_ids(c).items() if v is not None}
    return dict(_from_model_config=True, **ids, output_attentions=False, output_hidden_states=False, use_cache=True)


def hf_config_dict(c: TransformerConfig, model_type: str | None = None, *, dtype: str | None = None) -> dict:
    """The config.json of ``c`` as ``model_type`` (default: ``infer_model_type``: the family ``c``
    is), stored as ``dtype`` (default: ``c.param_dtype``); a ``ValueError`` names any feature that
    family cannot express (``Family.to_hf``)."""
    d = family_named(infer_model_type(c) if model_type is None else model_type).to_hf(c)
    # torch_dtype: the key transformers < 4.56 reads; a dtype is checked ("bf16" was written as given)
    d["dtype"] = d["torch_dtype"] = c.param_dtype if dtype is None else dtype_name("dtype", dtype)
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
    # checked before anything is written: max_shard_size=0 / -1 / True wrote one file per tensor, "5GB" failed
    # deep in the shard planning, and a path that is a file failed in os.makedirs
    max_shard_size = check_positive_int("max_shard_size", as_scalar(max_shard_size))
    path = os.fspath(path)
    problem = output_dir_problem(path)
    if problem:
        raise NotADirectoryError(f"path={path!r}: no checkpoint directory can be made there: {problem}")
    c = model.config
    family = family_named(infer_model_type(c) if model_type is None else model_type)
    out_dtype = np.dtype(dtype_name("dtype", dtype if dtype is not None else c.param_dtype))
    config = hf_config_dict(c, family.model_type, dtype=out_dtype.name)
    names = family.name_map(c)
    params = named_leaves(model, jax.Array)
    where, sizes = {}, {}
    for p, tn in names.items():
        shape = params[p].shape
        for layer in range(shape[0]) if tn.stacked else (None,):
            name = tn.hf_name(layer)
            where[name] = (p, layer)
            sizes[name] = int(np.prod(hf_shape(tn, shape))) * out_dtype.itemsize

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
    if main:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(generation_config_dict(c), f, indent=2, sort_keys=True)
    return write_checkpoint(path, sizes, produce, max_shard_size=max_shard_size, write=main)


__all__ = ["generation_config_dict", "hf_config_dict", "infer_model_type", "save_hf"]
