"""Hugging Face checkpoints in and out: ``config_from_hf`` (config.json → ``TransformerConfig``),
``load_hf`` (a checkpoint directory → ``Transformer``, optionally straight into FSDP shardings),
``save_hf`` (a ``Transformer`` → a directory ``transformers.AutoModelForCausalLM.from_pretrained``
loads). Families (``model_type``): ``SUPPORTED_MODEL_TYPES``, one ``Family`` record each in ``FAMILIES``
(``families.py``), which both directions read.

Needs ``pip install -e ".[hf]"`` (safetensors) for weights; ``config_from_hf`` needs nothing
beyond ringsplash. Never imports torch or transformers.
"""

from ringsplash.hf.config import config_from_hf
from ringsplash.hf.families import FAMILIES, SUPPORTED_MODEL_TYPES
from ringsplash.hf.family import Family
from ringsplash.hf.io import bytes_read, reset_bytes_read
from ringsplash.hf.load import load_hf
from ringsplash.hf.save import hf_config_dict, save_hf

__all__ = ["FAMILIES", "SUPPORTED_MODEL_TYPES", "Family", "bytes_read", "config_from_hf", "hf_config_dict", "load_hf",
           "reset_bytes_read", "save_hf"]
