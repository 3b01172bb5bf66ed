"""The on-chip tier for the experiment scripts and the evaluation CLI: each script's default
configuration (its model, its dtypes: bfloat16 compute on a TPU, its tuned Splash blocks) runs a
few steps on the chip, extend_context.py through its whole evaluation grid, and
``python -m ringsplash.evals`` runs ``passkey``, ``niah`` and ``ruler`` at 8K tokens.

Run on a TPU machine with ``JAX_PLATFORMS=tpu python -m pytest -m tpu``; everywhere else (CI has
no TPU) every test here skips, saying so (``tests/conftest.py``). Everything runs in the test
process: the chip belongs to one process at a time.
"""

import importlib.util
import json
import math
import os

import jax
import pytest

pytestmark = pytest.mark.tpu

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _job(name):
    spec = importlib.util.spec_from_file_location(f"_on_chip_{name}", os.path.join(ROOT, "experiments", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _finite(x) -> bool:
    return all(math.isfinite(v) for v in jax.tree.leaves(x) if isinstance(v, float))


def test_extend_context_default_through_its_evaluation_grid_on_chip(tmp_path, capsys):
    """The default run (every method, base 1K extended 8x, bfloat16 compute) with 3 base and 2 finetune
    steps: every method is evaluated at every length (perplexity and passkey), every number finite. Its
    first evaluation (the scoring path: ``jax.vmap`` over a batch) once died in Mosaic for scoped VMEM."""
    job = _job("extend_context")
    config = job.Config(base_steps=3, finetune_steps=2, passkey_docs=16, run_dir=str(tmp_path / "run"),
                        corpus_dir=str(tmp_path / "corpora"), progress=False)
    result = job.main(config)
    assert result["returncode"] == 0 and result["all_finite"], result["table"]
    assert "compute=bfloat16" in capsys.readouterr().out
    assert result["lengths"][-1] == config.factor * config.base_len
    assert {r["method"] for r in result["results"]} == set(config.method_list)


def test_train_long_context_default_on_chip(tmp_path, capsys):
    job = _job("train_long_context")
    result = job.main(job.Config(steps=4, warmup_steps=1, eval_every=0, eval_batches=1, run_dir=str(tmp_path / "run"),
                                 progress=False))
    out = capsys.readouterr().out
    assert "compute=bfloat16" in out, out
    assert math.isfinite(result["heldout_loss"]) and math.isfinite(result["heldout_accuracy"])


def test_byte_lm_default_on_chip(tmp_path, capsys):
    job = _job("byte_lm")
    result = job.main(job.Config(steps=4, warmup_steps=1, eval_batches=1, run_dir=str(tmp_path / "run"),
                                 corpus_dir=str(tmp_path / "corpora"), progress=False))
    assert "compute=bfloat16" in capsys.readouterr().out
    assert _finite(result["rows"])


@pytest.fixture(scope="module")
def model_8k(tmp_path_factory):
    """A small random byte-level model of 8K tokens, saved as a Hugging Face checkpoint."""
    from ringsplash.hf import save_hf
    from ringsplash.model import Transformer, TransformerConfig

    config = TransformerConfig(vocab_size=256, d_model=128, num_layers=2, num_heads=4, max_seq_len=8192)
    path = tmp_path_factory.mktemp("hf") / "tiny8k"
    save_hf(Transformer(config, key=jax.random.key(0)), str(path))
    return str(path)


@pytest.mark.parametrize("task", ["passkey", "niah", "ruler"])
def test_eval_cli_at_8k_on_chip(task, model_8k, tmp_path):
    from ringsplash.evals.cli import main

    extra = ["--ruler-tasks", "niah_single", "--max-new-tokens", "8"] if task == "ruler" else ["--depths", "0.5"]
    out = tmp_path / task
    result = main([task, "--model", model_8k, "--tokenizer", "bytes", "--lengths", "8K", "--samples", "1",
                   "--batch-size", "1", "--compute-dtype", "bfloat16", "--out", str(out), *extra])
    assert (out / "table.md").exists() and json.loads((out / "result.json").read_text())["task"] == task
    assert result["summary"], result
