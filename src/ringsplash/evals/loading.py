"""Models and generation for the evaluations: a Hugging Face directory (``ringsplash.hf.load_hf``)
or a ringsplash training run directory (``train.fit`` 's ``config.json`` + ``checkpoints/``), run on
one device with a single-device attention strategy; ``generate_fn`` over ``rs.inference.generate``."""

import json
import os

import jax.numpy as jnp
import numpy as np

from ringsplash.evals.scoring import GenerateFn
from ringsplash.model import Transformer
from ringsplash.model.parallelism import SINGLE_DEVICE_STRATEGIES

SINGLE_DEVICE = SINGLE_DEVICE_STRATEGIES


def single_device(model: Transformer, attention: str = "splash") -> Transformer:
    """``model`` 's parameters under a one-device strategy (``ContextParallel.single_device``); the
    parameters are unchanged."""
    if attention not in SINGLE_DEVICE:
        raise ValueError(f"attention={attention!r} must be one of {SINGLE_DEVICE} (the evaluations run on one device)")
    config = _single_device_config(model.config, attention)
    return model if config == model.config else model.with_config(config)


def _single_device_config(c, attention: str):
    return c.replace(context_parallel=c.context_parallel.single_device(attention))


def load_model(path: str, *, attention: str = "splash", param_dtype: str = "float32",
               compute_dtype: str | None = None) -> Transformer:
    """The model in ``path``: a Hugging Face checkpoint directory (``config.json`` with ``model_type``)
    or a ringsplash run directory (``config.json`` with ``model`` / ``train``, and ``checkpoints/``)."""
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise FileNotFoundError(f"path={path!r} must be a Hugging Face checkpoint or a ringsplash run directory; "
                                f"it has no config.json")
    with open(cfg) as f:
        d = json.load(f)
    if "model_type" in d:
        from ringsplash.hf import load_hf

        return load_hf(path, param_dtype=param_dtype, compute_dtype=compute_dtype, attention=attention)
    if "model" in d and "train" in d:
        return _load_run(path, d, attention)
    raise ValueError(f"{cfg} is neither a Hugging Face config (no model_type) nor a ringsplash run's config "
                     f"(no model / train entries)")


def _load_run(path: str, d: dict, attention: str) -> Transformer:
    # the trainer's own restore (parameters + optimiser state, then the model is kept): a run directory
    # is the trainer's format, so reading it goes through ringsplash.train
    from ringsplash import checkpoints, train
    from ringsplash.model import TransformerConfig

    ckpt = os.path.join(path, "checkpoints")
    if checkpoints.latest_step(ckpt) is None:
        raise FileNotFoundError(f"run directory {path} has no checkpoint under {ckpt}")
    config = TransformerConfig.from_dict(d["model"])
    tc = train.TrainConfig.from_dict({**d["train"], "data_parallel": 1})
    # the saved strategy may need a context axis: restore onto one device with the single-device strategy
    if attention not in SINGLE_DEVICE:
        raise ValueError(f"attention={attention!r} must be one of {SINGLE_DEVICE} (the evaluations run on one device)")
    config1 = _single_device_config(config, attention)
    mesh = train.make_mesh(1, 1)
    state = train.restore_sharded_state(ckpt, config1, tc, mesh, train.sharding_plan(config1, mesh, False),
                                        int(d.get("data_seed", 0)))
    return state.model


def inference_generate_fn(model: Transformer, **kwargs) -> GenerateFn:
    """A ``generate_fn`` over ``rs.inference.generate(model, prompts, n, prompt_lengths=..., **kwargs)``
    (greedy by default); a clear error if this installation has no ``ringsplash.inference``."""
    try:
        from ringsplash import inference
    except ImportError as e:
        raise ImportError("generative scoring needs ringsplash.inference (rs.inference.generate), which this "
                          "installation does not have: pass --no-generate for the teacher-forced scores only, "
                          "or pass your own generate_fn") from e

    def generate(prompts: np.ndarray, prompt_lengths: np.ndarray, max_new_tokens: int) -> np.ndarray:
        out = inference.generate(model, jnp.asarray(prompts, jnp.int32), int(max_new_tokens),
                                 prompt_lengths=jnp.asarray(prompt_lengths, jnp.int32), **kwargs)
        return np.asarray(out)

    return generate


__all__ = ["SINGLE_DEVICE", "inference_generate_fn", "load_model", "single_device"]
