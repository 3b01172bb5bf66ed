"""The API reference (mkdocs + mkdocstrings, ``mkdocs.yml``) builds from the docstrings with warnings as errors."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.e2e
@pytest.mark.cheap
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason='the API reference needs mkdocs and mkdocstrings: pip install -e ".[test]"')
def test_api_reference_builds_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    model = (tmp_path / "site" / "model" / "index.html").read_text()
    assert "TransformerConfig" in model and "ContextParallel" in model
    assert "splash_attention" in (tmp_path / "site" / "attention" / "index.html").read_text()
