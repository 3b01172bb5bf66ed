"""Greedy ``rs.inference.generate`` on tiny random models made by transformers and imported with
``ringsplash.hf.load_hf``: exactly transformers' ``generate(do_sample=False)`` token ids (float32)."""

import jax.numpy as jnp
import numpy as np
import pytest

from ringsplash.hf import load_hf
from ringsplash.inference import generate

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
FAMILIES = {
    "llama": ("LlamaConfig", TINY),
    # a window of 6 tokens: the 12 new tokens after a 10-token prompt look back past it
    "mistral": ("MistralConfig", dict(TINY, sliding_window=6)),
}
PROMPT, NEW = 10, 12


def _hf_model(kind: str, directory: str):
    import torch
    import transformers

    cls_name, kwargs = FAMILIES[kind]
    torch.manual_seed(0)
    config = getattr(transformers, cls_name)(**kwargs, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # unit-scale activations (the 0.02 init gives near-constant logits)
        for _, p in sorted(model.named_parameters()):
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + 1.0)
    model.save_pretrained(directory)
    model.generation_config.eos_token_id = None  # generate all NEW tokens
    model.generation_config.pad_token_id = 0
    return model


def _torch_greedy(model, prompt: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        ids = torch.from_numpy(prompt.astype(np.int64))[None]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                             min_new_tokens=NEW)
    return out[0, prompt.shape[0]:].numpy()


@pytest.mark.slow  # 5-6 s each (transformers generate + two compiles)
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_greedy_generate_equals_transformers(kind, tmp_path):
    hf = _hf_model(kind, str(tmp_path))
    model = load_hf(str(tmp_path))
    prompts = np.random.default_rng(1).integers(0, TINY["vocab_size"], (2, PROMPT)).astype(np.int32)
    lengths = np.array([PROMPT, 7])  # the second row's prompt is its first 7 tokens
    ours = np.asarray(generate(model, jnp.asarray(prompts), NEW, prompt_lengths=jnp.asarray(lengths)))
    for b in range(2):
        np.testing.assert_array_equal(ours[b], _torch_greedy(hf, prompts[b, :lengths[b]]))
