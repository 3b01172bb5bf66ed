"""Optional dependencies (``ringsplash._internal.optional``): a package that is not installed is one line naming
what needs it and the extra that installs it, wherever it is imported; never a traceback from deep inside.
Each test makes the package missing as Python sees it (``sys.modules[name] = None``)."""

import importlib.util
import os
import sys

import pytest

from ringsplash import data
from ringsplash._internal.optional import MissingDependency, require

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _missing(monkeypatch, package: str) -> None:
    """``package`` (and every submodule already imported) as if not installed."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, package, None)


def _one_line(message: str) -> str:
    assert "\n" not in message, message
    return message


def test_require_names_what_needs_it_and_the_extra(monkeypatch):
    _missing(monkeypatch, "tokenizers")
    with pytest.raises(MissingDependency) as err:
        require("tokenizers", extra="data", needed_for="a tokenizer.json tokenizer")
    assert _one_line(str(err.value)) == 'a tokenizer.json tokenizer needs tokenizers: pip install -e ".[data]"'
    assert isinstance(err.value, ImportError) and err.value.__cause__ is None and err.value.__suppress_context__


def test_require_keeps_an_import_error_from_inside_an_installed_package(tmp_path, monkeypatch):
    """A package that is there but cannot import one of its own dependencies is not "not installed":
    its own error (naming the dependency) goes up as it is."""
    (tmp_path / "half_installed").mkdir()
    (tmp_path / "half_installed" / "__init__.py").write_text("import not_a_module_anywhere_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as err:
        require("half_installed", extra="data", needed_for="this test")
    assert not isinstance(err.value, MissingDependency) and err.value.name == "not_a_module_anywhere_xyz"


def test_tokenize_corpus_without_tokenizers_names_the_data_extra(tmp_path, monkeypatch):
    (tmp_path / "doc.txt").write_text("a document")
    (tmp_path / "tokenizer.json").write_text("{}")  # never read: the package is missing
    _missing(monkeypatch, "tokenizers")
    with pytest.raises(MissingDependency, match=r'tokenizer\.json.* needs tokenizers: pip install -e "\.\[data\]"$'):
        data.tokenize_corpus([str(tmp_path / "doc.txt")], str(tmp_path / "c"),
                             data.TokenizeOptions(tokenizer=str(tmp_path / "tokenizer.json")), progress=False)


def test_tokenize_corpus_script_without_tokenizers_is_one_line(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("tokenize_corpus_script", os.path.join(ROOT, "scripts",
                                                                                         "tokenize_corpus.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    (tmp_path / "doc.txt").write_text("a document")
    (tmp_path / "tokenizer.json").write_text("{}")
    _missing(monkeypatch, "tokenizers")
    with pytest.raises(SystemExit) as exit_:
        script.main([str(tmp_path / "doc.txt"), str(tmp_path / "c"), "--tokenizer", str(tmp_path / "tokenizer.json"),
                     "--no-progress"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith('needs tokenizers: pip install -e ".[data]"'), err


def test_loader_without_grain_says_to_reinstall(monkeypatch):
    """Grain is a core dependency: an environment installed before it was one is told ``pip install -e .``."""
    _missing(monkeypatch, "grain")
    with pytest.raises(MissingDependency, match=r"ringsplash\.data\.Loader .* needs grain: pip install -e \.$"):
        data.Loader("no/corpus/needed", data.LoaderConfig(seq_len=16, batch_size=2))


def test_lm_eval_adapter_without_lm_eval_names_the_evals_extra(monkeypatch):
    _missing(monkeypatch, "lm_eval")
    monkeypatch.delitem(sys.modules, "ringsplash.evals.lm_eval_adapter", raising=False)
    with pytest.raises(MissingDependency, match=r'lm_eval_adapter .* needs lm-eval: pip install -e "\.\[evals\]"$'):
        importlib.import_module("ringsplash.evals.lm_eval_adapter")
    monkeypatch.delitem(sys.modules, "ringsplash.evals.lm_eval_adapter", raising=False)  # the half-run import


def test_evals_tokenizer_json_without_tokenizers_names_the_hf_extra(tmp_path, monkeypatch):
    from ringsplash.evals.tokenizer import HFTokenizer

    (tmp_path / "tokenizer.json").write_text("{}")
    _missing(monkeypatch, "tokenizers")
    with pytest.raises(MissingDependency, match=r'needs tokenizers: pip install -e "\.\[hf\]"$'):
        HFTokenizer(str(tmp_path / "tokenizer.json"))
